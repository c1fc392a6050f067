import { randomUUID } from 'node:crypto';
import type { z } from 'zod';
import {
  batchAccepted,
  batchList,
  batchStatus,
  cryptoResponse,
  keyInfo,
  keyList,
  resultLine,
  type BatchAccepted,
  type BatchList,
  type BatchOp,
  type BatchStatusBody,
  type CryptoResponse,
  type KeyInfo,
  type KeyList,
  type KeyPolicyPatch,
  type ResultLine,
} from '../shared/schemas.js';
import type { KeyType } from '../shared/crypto/key-ring.js';
import { MAX_TIMER_MS } from '../shared/timers.js';
import { MAX_TOKEN_LENGTH, MIN_TOKEN_LENGTH, TOKEN_CHARACTERS } from '../shared/tokens.js';
import { failureReason, KeyfleetApiError, KeyfleetConnectionError, KeyfleetTimeoutError, sendAgainWith } from './errors.js';
import { delay, GATEWAY_ANSWERS, retryDelayMs, withRetries, type RetryOptions } from './retry.js';
import { readServerEvents } from './sse.js';
import { AttemptLimits, limitedBody, type AttemptOf, type Limits } from './time-limits.js';

export interface ClientOptions {
  /** The API's base URL, e.g. `http://127.0.0.1:8080`. */
  readonly url: string;
  /** A bearer token of `KEYFLEET_TOKENS`. */
  readonly token: string;
  /**
   * Retries of 429 and 503 answers (Retry-After honoured; a 503 of a call not safe to repeat only
   * when the API says nothing was done), of 409 KF_IDEMPOTENCY_IN_PROGRESS (a retry that found
   * the first attempt still running waits for its answer), and of a call with an Idempotency-Key
   * that timed out (timeoutMs, idleTimeoutMs), with the same key.
   */
  readonly retry?: RetryOptions;
  /**
   * How long a call waits for the API to begin its answer, in ms (default 30 s): from the
   * request being sent (an upload: from its last piece) to the answer's status and headers. A
   * call past it fails with a KeyfleetTimeoutError naming the call and the limit; one that
   * changes something (a rotation, a batch) may have been done, and its message says so. It is
   * not sent again, unless it carries an Idempotency-Key (an upload, a crypto call in mode async
   * or with `idempotencyKey`, a key creation): that one is, with the same key, within
   * `retry.attempts`, and the last attempt's error names the key.
   */
  readonly timeoutMs?: number;
  /**
   * How long a body may stand still because of the API, in ms (default 60 s): the next piece of
   * an answer (a results download; an event stream, where the API sends a keep-alive every 15 s),
   * or a piece of an upload that the API does not take. A download or a wait is never cut off
   * for its length, only for such a silence (a KeyfleetTimeoutError; waitForBatch opens a silent
   * event stream again, up to its `reconnects`). An overall limit is the caller's own signal,
   * e.g. `AbortSignal.timeout(ms)`.
   */
  readonly idleTimeoutMs?: number;
}

export interface CryptoOptions {
  /** How plaintexts are written: utf8 text (default) or base64 bytes. */
  readonly encoding?: 'utf8' | 'base64';
  /** `auto` (default) answers up to SYNC_MAX_ITEMS items in the response and makes a batch of more; `sync` refuses more; `async` always makes a batch. */
  readonly mode?: 'auto' | 'sync' | 'async';
  /** Bound into the associated data of every item that gives none of its own; decrypt and rewrap need the same one. */
  readonly context?: string;
  /** Rewrap only: re-encrypt into this key. */
  readonly targetKey?: string;
  /** Encrypt only, answered in the response only: seal under this version (minEncryptionVersion to latest) instead of the latest. */
  readonly keyVersion?: number;
  /** When the call becomes a batch: where the API POSTs its final status, signed (see verifyWebhookSignature). */
  readonly callbackUrl?: string;
  /** Makes a retry of this call safe: the same key and request give the first answer again. */
  readonly idempotencyKey?: string;
  /** Ends the call (its request, or the wait before a retry) when it aborts: it rejects with the signal's reason. */
  readonly signal?: AbortSignal;
}

/** A plaintext to encrypt: the text, or the text with a context of its own (answered in the response only; a batch takes one context for all). */
export type PlaintextItem = string | { readonly plaintext: string; readonly context?: string };
/** A ciphertext to decrypt or rewrap: as encrypt gave it, or with the context it was sealed under. */
export type CiphertextItem = string | { readonly ciphertext: string; readonly context?: string };

export interface BatchRequest {
  readonly op: BatchOp;
  readonly key: string;
  readonly encoding?: 'utf8' | 'base64';
  readonly context?: string;
  /** op=rewrap only: re-encrypt into this key (migration from a legacy key). */
  readonly targetKey?: string;
  readonly idempotencyKey?: string;
  /** Where the API POSTs the final status, signed (see verifyWebhookSignature). */
  readonly callbackUrl?: string;
  /** Ends the upload (or the wait before a retry) when it aborts. */
  readonly signal?: AbortSignal;
}

/** What a sync call answers: the results, or (above SYNC_MAX_ITEMS, or `mode: "async"`) a batch. */
export type CryptoAnswer = ({ kind: 'results' } & CryptoResponse) | ({ kind: 'batch' } & BatchAccepted);

/** A body the client can send again on retry: a factory of its pieces. */
export type BodySource = () => AsyncIterable<Uint8Array | string> | Iterable<Uint8Array | string>;

const encoder = new TextEncoder();
/** What the API reads after `Bearer ` and takes in KEYFLEET_TOKENS (shared/tokens.ts): anything else could never authenticate. */
const TOKEN = new RegExp(`^[${TOKEN_CHARACTERS}]{${MIN_TOKEN_LENGTH},${MAX_TOKEN_LENGTH}}$`);

/**
 * A typed client of every keyfleet route, over fetch. Answers are checked against the same zod
 * schemas the API validates with; 429 and 503 are retried with backoff, honouring Retry-After,
 * but never so that the work is done twice (#send); an API that keeps a call waiting past the
 * client's time limits ends it (#attempt).
 */
export class KeyfleetClient {
  readonly url: string;
  readonly #token: string;
  readonly #retry: RetryOptions;
  readonly #limits: Limits;

  // Neither message shows the secret it refuses: a token, or a password in the URL, would be
  // printed by the CLI and end up in logs.
  constructor({ url, token, retry = {}, timeoutMs = 30_000, idleTimeoutMs = 60_000 }: ClientOptions) {
    if (!/^https?:\/\//.test(url)) throw new Error(`keyfleet client: expected an http(s) URL, got ${JSON.stringify(withoutUserinfo(url))}`);
    let parsed: URL;
    try {
      parsed = new URL(url);
    } catch {
      throw new Error(`keyfleet client: expected an http(s) URL, got ${JSON.stringify(withoutUserinfo(url))}`);
    }
    if (parsed.username || parsed.password) throw new Error('keyfleet client: the URL holds credentials (user:password@); give the API’s URL without them, and the bearer token as the token (KEYFLEET_TOKEN)');
    if (!token) throw new Error('keyfleet client: a token is required (KEYFLEET_TOKEN)');
    if (!TOKEN.test(token)) throw new Error(`keyfleet client: the token must be ${MIN_TOKEN_LENGTH}-${MAX_TOKEN_LENGTH} visible ASCII characters (no spaces, line breaks or other characters), as the API reads it; check KEYFLEET_TOKEN`);
    this.url = url.replace(/\/+$/, '');
    this.#token = token;
    this.#retry = retry;
    this.#limits = { timeoutMs: limitOption('timeoutMs', timeoutMs), idleTimeoutMs: limitOption('idleTimeoutMs', idleTimeoutMs) };
  }

  // ---- keys -----------------------------------------------------------------------------
  async createKey(name: string, type?: KeyType, options: { convergent?: boolean } = {}): Promise<KeyInfo & { created: boolean }> {
    const body = type || options.convergent ? { ...(type ? { type } : {}), ...(options.convergent ? { convergent: true } : {}) } : undefined;
    // Repeatable: the API answers 200 for a key that exists with the same type. The key of its
    // own, the same on every retry, has a retry after a lost 201 get that 201 again: without
    // it, the retry would find the key it made and say `created: false`.
    const res = await this.#send('POST', `/v1/keys/${encodeURIComponent(name)}`, body, { repeatable: true, idempotencyKey: randomUUID() });
    return { ...(await this.#json(res, keyInfo)), created: res.status === 201 };
  }

  /**
   * Imports a legacy AES-256-CBC key (32 bytes): it decrypts and rewraps, into another key with
   * targetKey. Not retried after a gateway's 503 (nor are rotateKey, deleteKey and cancelBatch):
   * the API may have done it already.
   */
  async importLegacyKey(name: string, material: Uint8Array): Promise<KeyInfo> {
    const res = await this.#send('POST', `/v1/keys/${encodeURIComponent(name)}/import`, { type: 'legacy-aes256-cbc', material: Buffer.from(material).toString('base64') });
    return this.#json(res, keyInfo, 201);
  }

  /** Changes a key's policy: minDecryptionVersion, minEncryptionVersion, deletionAllowed, autoRotatePeriod. */
  async patchKey(name: string, patch: KeyPolicyPatch): Promise<KeyInfo> {
    // Repeatable: the patch sets values, it does not add to them.
    return this.#json(await this.#send('PATCH', `/v1/keys/${encodeURIComponent(name)}`, patch, { repeatable: true }), keyInfo);
  }

  async trimKey(name: string, minAvailableVersion: number): Promise<KeyInfo> {
    return this.#json(await this.#send('POST', `/v1/keys/${encodeURIComponent(name)}/trim`, { minAvailableVersion }, { repeatable: true }), keyInfo);
  }

  /** Deletes a key marked deletionAllowed. */
  async deleteKey(name: string): Promise<void> {
    const res = await this.#send('DELETE', `/v1/keys/${encodeURIComponent(name)}`);
    if (res.status !== 204) throw await apiError(res);
  }

  async getKey(name: string): Promise<KeyInfo> {
    return this.#json(await this.#send('GET', `/v1/keys/${encodeURIComponent(name)}`), keyInfo);
  }

  /** One page of the tenant's keys in name order (100, or `limit` up to 1,000); `next`, when present, is the `after` of the page that follows. */
  async listKeys({ after, limit }: { after?: string; limit?: number } = {}): Promise<KeyList> {
    return this.#json(await this.#send('GET', withQuery('/v1/keys', { after, limit })), keyList);
  }

  /** Every key of the tenant in name order, read a page at a time. */
  allKeys({ pageSize }: { pageSize?: number } = {}): AsyncGenerator<KeyInfo> {
    return everyItem(async (after) => {
      const { keys, next } = await this.listKeys({ ...(after !== undefined ? { after } : {}), ...(pageSize !== undefined ? { limit: pageSize } : {}) });
      return { items: keys, next };
    });
  }

  async rotateKey(name: string): Promise<KeyInfo> {
    return this.#json(await this.#send('POST', `/v1/keys/${encodeURIComponent(name)}/rotate`), keyInfo);
  }


  // ---- sync crypto ----------------------------------------------------------------------
  encrypt(key: string, items: readonly PlaintextItem[], options?: CryptoOptions): Promise<CryptoAnswer> {
    return this.#crypto('encrypt', key, items, options);
  }

  decrypt(key: string, items: readonly CiphertextItem[], options?: CryptoOptions): Promise<CryptoAnswer> {
    return this.#crypto('decrypt', key, items, options);
  }

  rewrap(key: string, items: readonly CiphertextItem[], options?: CryptoOptions): Promise<CryptoAnswer> {
    return this.#crypto('rewrap', key, items, options);
  }

  // ---- batches --------------------------------------------------------------------------
  /** Uploads items (strings) as NDJSON, streamed; `items` is called again if the upload is retried. */
  createBatch(request: BatchRequest, items: () => AsyncIterable<string> | Iterable<string>): Promise<BatchAccepted & { readonly replayed?: true }> {
    return this.createBatchFromNdjson(request, async function* () {
      // Lines are gathered into pieces of about 64 KB: one write per item would dominate.
      let piece = '';
      for await (const item of items()) {
        piece += JSON.stringify(item) + '\n';
        if (piece.length >= 65_536) {
          yield piece;
          piece = '';
        }
      }
      if (piece) yield piece;
    });
  }

  /**
   * Uploads an NDJSON body (one JSON string per line) as it is, streamed. Without an
   * `idempotencyKey` the upload gets one of its own, the same on every retry: a gateway's 503
   * after the API accepted it then gives back the same batch, not a second one. `replayed`: the
   * answer is the batch that this key made before (the API's `Idempotent-Replayed: true`).
   */
  async createBatchFromNdjson(request: BatchRequest, body: BodySource): Promise<BatchAccepted & { readonly replayed?: true }> {
    const { op, key, encoding, callbackUrl, context, targetKey } = request;
    const query = new URLSearchParams({ op, key, ...(encoding ? { encoding } : {}), ...(callbackUrl ? { callbackUrl } : {}), ...(context !== undefined ? { context } : {}), ...(targetKey ? { targetKey } : {}) });
    const idempotencyKey = request.idempotencyKey ?? randomUUID();
    const res = await this.#send('POST', `/v1/batches?${query}`, undefined, { headers: { 'content-type': 'application/x-ndjson' }, idempotencyKey, stream: body, repeatable: true, ...(request.signal ? { signal: request.signal } : {}) });
    const accepted = await this.#json(res, batchAccepted, 202);
    return res.headers.get('idempotent-replayed') === 'true' ? { ...accepted, replayed: true } : accepted;
  }

  async batch(id: string): Promise<BatchStatusBody> {
    return this.#json(await this.#send('GET', `/v1/batches/${encodeURIComponent(id)}`), batchStatus);
  }

  /** One page of the tenant's batches, newest first (100, or `limit` up to 1,000); `next`, when present, is the `before` of the page that follows. */
  async listBatches({ before, limit }: { before?: string; limit?: number } = {}): Promise<BatchList> {
    return this.#json(await this.#send('GET', withQuery('/v1/batches', { before, limit })), batchList);
  }

  /** Every batch the tenant's listing keeps, newest first, read a page at a time. */
  allBatches({ pageSize }: { pageSize?: number } = {}): AsyncGenerator<BatchStatusBody> {
    return everyItem(async (before) => {
      const { batches, next } = await this.listBatches({ ...(before !== undefined ? { before } : {}), ...(pageSize !== undefined ? { limit: pageSize } : {}) });
      return { items: batches, next };
    });
  }

  /** The batch’s status now and at every change, ending with its final status; a batch whose record goes meanwhile (expired, deleted) ends it with an error. */
  async *events(id: string, signal?: AbortSignal): AsyncGenerator<BatchStatusBody & { final: boolean }> {
    const res = await this.#send('GET', `/v1/batches/${encodeURIComponent(id)}/events`, undefined, signal ? { signal } : {});
    if (!res.ok || !res.body) throw await apiError(res);
    for await (const { event, data } of readServerEvents(res.body)) {
      const parsed: unknown = JSON.parse(data);
      // The API's last word on a batch whose record is gone (expired, or deleted) while watched.
      if (event === 'done' && (parsed as { status?: unknown } | null)?.status === 'deleted') throw new Error(`batch ${id} expired or was deleted`);
      const status = batchStatus.safeParse(parsed);
      if (!status.success) throw new Error(`batch ${id}: an event that is not a status: ${data.slice(0, 200)}`);
      yield { ...status.data, final: event === 'done' };
      if (event === 'done') return;
    }
  }

  /**
   * Waits for the batch's final status (completed, failed or cancelled). A stream that breaks,
   * goes silent for `idleTimeoutMs` or ends early (an API restarting, a proxy's time limit) is
   * opened again, after a backoff; `reconnects` streams in a row that neither brought progress
   * nor lasted a minute end the wait (a silent one never counts as lasting: an API that holds
   * streams open and says nothing ends the wait after about (reconnects + 1) × idleTimeoutMs).
   * So does an answer of the API (a 404, a 401), and an API that cannot be reached before any
   * stream opened, unless `apiReached` says it answered before (an upload just accepted): a
   * wrong URL fails at once, not after the reconnections. `signal` ends the wait at any point.
   */
  async waitForBatch(id: string, onProgress?: (status: BatchStatusBody) => void, { reconnects = 8, apiReached = false, signal }: { reconnects?: number; apiReached?: boolean; signal?: AbortSignal } = {}): Promise<BatchStatusBody> {
    let processed = -1;
    let connected = apiReached;
    for (let failures = 0; ; ) {
      let reason: string;
      const opened = Date.now();
      let advanced = false;
      let silent = false;
      try {
        for await (const status of this.events(id, signal)) {
          connected = true;
          if (status.processed > processed) advanced = true;
          processed = Math.max(processed, status.processed);
          onProgress?.(status);
          if (status.final) return status;
        }
        reason = 'the event stream ended without a final status';
      } catch (err) {
        if (!isStreamBreak(err) || (err instanceof KeyfleetConnectionError && !connected)) throw err;
        silent = err instanceof KeyfleetTimeoutError;
        reason = `the event stream broke (${err instanceof TypeError ? failureReason(err.cause as Error) : err.message})`;
      }
      if (advanced || (!silent && Date.now() - opened >= 60_000)) failures = 0;
      if (++failures > reconnects) throw new Error(`batch ${id}: ${reason}, ${reconnects} reconnections in a row failed`);
      await delay(retryDelayMs(failures, null, { baseDelayMs: 500, maxDelayMs: 10_000, ...this.#retry }), signal);
    }
  }

  /** The result lines as the API sends them (NDJSON, input order), from item `from` on. */
  async *resultLines(id: string, { from = 0, signal }: { from?: number; signal?: AbortSignal } = {}): AsyncGenerator<string> {
    const res = await this.#send('GET', `/v1/batches/${encodeURIComponent(id)}/results${from ? `?from=${from}` : ''}`, undefined, signal ? { signal } : {});
    if (!res.ok || !res.body) throw await apiError(res);
    const decoder = new TextDecoder();
    let carry = '';
    for await (const piece of res.body) {
      const text = carry + decoder.decode(piece, { stream: true });
      const lines = text.split('\n');
      carry = lines.pop()!;
      for (const line of lines) if (line) yield line;
    }
    if (carry) yield carry;
  }

  /** The results, parsed, in input order, from item `from` on. */
  async *results(id: string, options: { from?: number; signal?: AbortSignal } = {}): AsyncGenerator<ResultLine> {
    for await (const line of this.resultLines(id, options)) yield resultLine.parse(JSON.parse(line));
  }

  /** Cancels what has not run and deletes the results. */
  async cancelBatch(id: string): Promise<BatchStatusBody> {
    return this.#json(await this.#send('DELETE', `/v1/batches/${encodeURIComponent(id)}`), batchStatus);
  }

  // ---- operations -----------------------------------------------------------------------
  async health(): Promise<boolean> {
    return (await this.#send('GET', '/healthz')).ok;
  }

  async ready(): Promise<boolean> {
    return (await this.#attempt('GET', '/readyz', { method: 'GET' }, { changes: false, retry: false })).ok;
  }

  // ---- plumbing -------------------------------------------------------------------------
  async #crypto(op: BatchOp, key: string, items: readonly (PlaintextItem | CiphertextItem)[], options: CryptoOptions = {}): Promise<CryptoAnswer> {
    const { idempotencyKey, signal, ...rest } = options;
    // A call that becomes a batch (mode async) gets a key of its own, so that a retry cannot make
    // a second batch. A sync call changes nothing and is sent again as it is. A call in mode auto
    // may be either: a key on every one would have the API store every sync answer for
    // IDEMPOTENCY_TTL_SECONDS, so it is sent again only after the API's own "nothing done".
    const retryKey = idempotencyKey ?? (options.mode === 'async' ? randomUUID() : undefined);
    const repeatable = retryKey !== undefined || options.mode === 'sync';
    // Only a call that may become a batch changes something: one in mode sync answers and is gone.
    const changes = options.mode !== 'sync';
    const res = await this.#send('POST', `/v1/${op}/${encodeURIComponent(key)}`, { items, ...rest }, { repeatable, changes, ...(retryKey ? { idempotencyKey: retryKey } : {}), ...(signal ? { signal } : {}) });
    if (res.status === 202) return { kind: 'batch', ...(await this.#json(res, batchAccepted, 202)) };
    return { kind: 'results', ...(await this.#json(res, cryptoResponse)) };
  }

  /**
   * One request, retried after 429 and 503. GET is repeatable; any other method is only if the
   * caller says so (`repeatable`: the API does it once however often it is sent), else a 503 is
   * retried only when the API itself says nothing was done (withRetries). Whether it is
   * repeatable or not, a call that `changes` something (any but a GET, unless the caller says
   * otherwise) may have been done once sent, and a timeout's message says so. A call with an
   * `idempotencyKey` is also sent again after a timeout, with the same key: its body can be (a
   * JSON string, or a stream's factory). If its attempts run out, the caller may not know that
   * key (the client's own), so the error names it.
   */
  async #send(method: string, path: string, json?: unknown, extra: { headers?: Record<string, string>; idempotencyKey?: string; stream?: BodySource; signal?: AbortSignal; repeatable?: boolean; changes?: boolean } = {}): Promise<Response> {
    const { idempotencyKey } = extra;
    const headers: Record<string, string> = { authorization: `Bearer ${this.#token}`, ...(json === undefined ? {} : { 'content-type': 'application/json' }), ...extra.headers, ...(idempotencyKey === undefined ? {} : { 'idempotency-key': idempotencyKey }) };
    const repeatable = method === 'GET' || extra.repeatable === true;
    const changes = extra.changes ?? method !== 'GET';
    const body = json === undefined ? undefined : JSON.stringify(json); // once, however often it is sent
    const attempt = (n: number): Promise<Response> => {
      const init: RequestInit & { duplex?: 'half' } = { method, headers };
      if (body !== undefined) init.body = body;
      return this.#attempt(method, path, init, { changes, idempotencyKey, retry: n > 1 }, extra.stream, extra.signal);
    };
    const res = await withRetries(attempt, this.#retry, { repeatable, idempotent: idempotencyKey !== undefined, ...(extra.signal ? { signal: extra.signal } : {}) });
    // A 409 is an error to every caller; one saying that the first attempt still runs names the key.
    if (idempotencyKey !== undefined && res.status === 409) throw await apiError(res, idempotencyKey);
    return res;
  }

  /**
   * One request under the client's time limits (AttemptLimits): the answer must begin within
   * timeoutMs of the request (of an upload's last piece), an upload's pieces must be taken and
   * the answer's come within idleTimeoutMs each. `of`: what a timeout says of the call.
   */
  async #attempt(method: string, path: string, init: RequestInit & { duplex?: 'half' }, of: AttemptOf, stream?: BodySource, signal?: AbortSignal): Promise<Response> {
    // The call as messages name it: without the query, which can carry a context.
    const limits = new AttemptLimits(this.url, `${method} ${path.replace(/\?.*$/, '')}`, this.#limits, of, signal);
    let sourceError: unknown;
    if (stream) {
      init.body = toStream(stream(), (err) => (sourceError = err), limits);
      init.duplex = 'half'; // a streamed request body (undici)
      // A request that may follow a redirect keeps a copy of its body to send again: undici
      // tees the stream, and the unread branch held the whole upload in memory. The API
      // never redirects.
      init.redirect = 'error';
    } else {
      limits.awaitAnswer();
    }
    try {
      return limitedBody(await fetch(this.url + path, { ...init, signal: limits.signal }), limits);
    } catch (err) {
      throw fetchError(err, this.url, sourceError);
    } finally {
      limits.answered();
    }
  }

  async #json<S extends z.ZodType>(res: Response, schema: S, expected = 0): Promise<z.infer<S>> {
    if (!res.ok || (expected && res.status !== expected)) throw await apiError(res);
    return schema.parse(await res.json());
  }
}

/** The items of every page of a listing, each page read with the `next` of the one before. */
async function* everyItem<T>(page: (cursor: string | undefined) => Promise<{ items: T[]; next?: string | undefined }>): AsyncGenerator<T> {
  let cursor: string | undefined;
  do {
    const { items, next } = await page(cursor);
    yield* items;
    cursor = next;
  } while (cursor !== undefined);
}

/** `path` with the parameters that are set as its query. */
function withQuery(path: string, params: Record<string, string | number | undefined>): string {
  const query = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) if (value !== undefined) query.set(name, String(value));
  return query.size > 0 ? `${path}?${query}` : path;
}

/** A time limit of ClientOptions, checked once: Node's timers take 1 ms to about 24.8 days. */
function limitOption(name: string, ms: unknown): number {
  if (typeof ms === 'number' && ms > 0 && ms <= MAX_TIMER_MS) return ms;
  throw new Error(`keyfleet client: ${name} must be a number of milliseconds > 0 and at most ${MAX_TIMER_MS}, got ${String(ms)}`);
}

/** The API's error answer. One saying that a keyed call still runs (KF_IDEMPOTENCY_IN_PROGRESS) names the key that gets its answer. */
async function apiError(res: Response, idempotencyKey?: string): Promise<KeyfleetApiError> {
  const text = await res.text().catch(() => '');
  try {
    const { error } = JSON.parse(text) as { error: { code: string; message: string } };
    const advice = idempotencyKey !== undefined && error.code === 'KF_IDEMPOTENCY_IN_PROGRESS' ? ` (${sendAgainWith(idempotencyKey)})` : '';
    return new KeyfleetApiError(res.status, error.code, error.message + advice);
  } catch {
    return new KeyfleetApiError(res.status, 'KF_UNEXPECTED_ANSWER', text.slice(0, 200) || res.statusText);
  }
}

/**
 * What a failed fetch becomes. undici reports every failure as `TypeError('fetch failed')` with
 * the reason as its cause, and that includes an error of the body's own source: that one is
 * given back as it is, since the API was reached. An abort stays as fetch threw it: the
 * caller's signal's reason, or a time limit's KeyfleetTimeoutError. A request
 * fetch refuses to make (a TypeError without a cause) is told without fetch's own message: it
 * quotes the header or URL it refused, and that can be the token.
 */
function fetchError(err: unknown, url: string, sourceError?: unknown): unknown {
  if (!(err instanceof TypeError)) return err;
  if (!(err.cause instanceof Error)) return new Error(`keyfleet client: fetch refused to send a request to ${url} (a header or the URL is malformed)`);
  if (err.cause === sourceError) return sourceError;
  return new KeyfleetConnectionError(url, err.cause);
}

/**
 * A break of a response already under way, or of the connection before it, or a gateway's
 * answer while the API behind it restarts (502, 503 once its own retries ran out, 504): not an
 * answer of the API about the batch. undici reports a body cut short as `TypeError('terminated')`
 * with the socket's error as its cause. Any other answer (404, 401) or an abort is not a break.
 */
function isStreamBreak(err: unknown): err is Error {
  if (err instanceof KeyfleetConnectionError) return true;
  if (err instanceof KeyfleetApiError) return GATEWAY_ANSWERS.has(err.status);
  return err instanceof TypeError && err.cause instanceof Error;
}

/** `url` with any `user:password@` left out, for a message. */
function withoutUserinfo(url: string): string {
  return url.replace(/^([a-z][a-z0-9+.-]*:\/\/)[^/?#]*@/i, '$1');
}

/**
 * An upload's source as a request body. The time the source takes is the client's own; from a
 * piece handed over until undici asks for the next (it takes a piece once the socket took the
 * one before), the API's; once the source ends, the answer's.
 */
function toStream(source: AsyncIterable<Uint8Array | string> | Iterable<Uint8Array | string>, onSourceError: (err: unknown) => void, limits: AttemptLimits): ReadableStream<Uint8Array> {
  const iterator = (Symbol.asyncIterator in source ? source[Symbol.asyncIterator]() : source[Symbol.iterator]()) as AsyncIterator<Uint8Array | string> | Iterator<Uint8Array | string>;
  return new ReadableStream<Uint8Array>({
    async pull(controller) {
      limits.pauseUpload();
      let next: IteratorResult<Uint8Array | string>;
      try {
        next = await iterator.next();
      } catch (err) {
        onSourceError(err);
        throw err;
      }
      const { value, done } = next;
      if (done) {
        controller.close();
        limits.awaitAnswer();
      } else {
        controller.enqueue(typeof value === 'string' ? encoder.encode(value) : value);
        limits.awaitTaken();
      }
    },
    async cancel() {
      await iterator.return?.();
    },
  });
}
