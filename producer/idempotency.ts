import { createHash, hash, type Hash } from 'node:crypto';
import type { IncomingMessage } from 'node:http';
import type { FastifyReply, FastifyRequest, FastifySchema, RawServerDefault, RouteGenericInterface } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import type { AtRestSealer } from '../shared/at-rest.js';
import { KeyfleetError } from '../shared/errors.js';
import type { Redis, RedisKeys } from '../shared/redis.js';

/** An answer as it was sent, kept to be sent again for the same key and request. */
export interface Answer {
  readonly status: number;
  readonly contentType: string;
  /** A JSON answer's text; a stored one's bytes. */
  readonly body: string | Buffer;
}

type Entry = { fp: string; state: 'pending' } | { fp: string; state: 'done'; status: number; type: string; body: string };

const HEADER = 'idempotency-key';
const VALID_KEY = /^[\x20-\x7e]{1,255}$/;
/**
 * A claimed key whose request is still running stays claimed this long unless renewed: a crashed
 * API frees it in time, and a long upload renews it (BatchIntake's keep-alive) as its body
 * arrives. An upload may wait UPLOAD_IDLE_SECONDS between pieces, so a claim lasts at least
 * twice that (pendingMs): at most about 2^32 ms, past Node's timers' 2^31−1 ms, but it is only
 * ever a Redis PX, never a timer.
 */
const PENDING_MS = 120_000;
export const pendingMs = (uploadIdleSeconds: number): number => Math.max(PENDING_MS, 2_000 * uploadIdleSeconds);

/** The request's Idempotency-Key, if it sent one; a malformed one is a 400. */
export function idempotencyKeyOf(request: FastifyRequest): string | undefined {
  const value = request.headers[HEADER];
  if (value === undefined) return undefined;
  if (typeof value !== 'string' || !VALID_KEY.test(value)) throw new KeyfleetError('KF_IDEMPOTENCY_KEY_INVALID');
  return value;
}

/**
 * What makes two requests "the same": method, path with query, and body. The hash comes back
 * with method and path in it, for a body that is hashed as it streams in (uploads).
 */
export function fingerprintHash(request: FastifyRequest): Hash {
  return createHash('sha256').update(`${request.method} ${request.url}\n`);
}

export function requestFingerprint(request: FastifyRequest, body: string | Buffer): string {
  return fingerprintHash(request).update(body).digest('hex');
}

/** A stored answer again, marked as a replay (as `respond`: the handler returns the body). */
export const replay = (reply: FastifyReply, answer: Answer): string | Buffer => respond(reply.header('idempotent-replayed', 'true'), answer);

/**
 * Idempotency-Key records in Redis, per tenant. The first request with a key claims it; the same
 * key with the same request gets the first answer again without the work being done twice; with
 * another request it is a 409. Answers may hold plaintexts (decrypt), so they are sealed at rest.
 */
export class IdempotencyStore {
  readonly #redis: Redis;
  readonly #keys: RedisKeys;
  readonly #sealer: AtRestSealer;
  readonly #ttlSeconds: number;
  readonly #pendingMs: number;

  /** `pendingMs`: how long a claim lives without renewal (pendingMs(UPLOAD_IDLE_SECONDS)). */
  constructor(redis: Redis, keys: RedisKeys, sealer: AtRestSealer, ttlSeconds: number, pendingMs: number) {
    this.#redis = redis;
    this.#keys = keys;
    this.#sealer = sealer;
    this.#ttlSeconds = ttlSeconds;
    this.#pendingMs = pendingMs;
  }

  /** The stored answer for this key, after checking it was given to the same request; undefined if none yet. */
  async find(tenant: string, key: string, fingerprint: string | (() => Promise<string>)): Promise<Answer | undefined> {
    const raw = await this.#redis.get(this.#slot(tenant, key));
    if (!raw) return undefined;
    const entry = JSON.parse(raw) as Entry;
    if (entry.state === 'pending') throw new KeyfleetError('KF_IDEMPOTENCY_IN_PROGRESS', undefined, { retryAfterSeconds: 1 });
    const fp = typeof fingerprint === 'string' ? fingerprint : await fingerprint();
    if (fp !== entry.fp) throw new KeyfleetError('KF_IDEMPOTENCY_MISMATCH');
    const body = this.#sealer.open('idempotency', this.#id(tenant, key), 'answer', Buffer.from(entry.body, 'base64'));
    return { status: entry.status, contentType: entry.type, body };
  }

  /** Claims the key for a request about to run; a concurrent claim of the same key is a 409. */
  async claim(tenant: string, key: string, fingerprint: string): Promise<void> {
    const entry: Entry = { fp: fingerprint, state: 'pending' };
    const claimed = await this.#redis.set(this.#slot(tenant, key), JSON.stringify(entry), 'PX', this.#pendingMs, 'NX');
    if (claimed !== 'OK') throw new KeyfleetError('KF_IDEMPOTENCY_IN_PROGRESS', undefined, { retryAfterSeconds: 1 });
  }

  /** Keeps a claim alive while its request runs long (a big upload). */
  async renew(tenant: string, key: string): Promise<void> {
    await this.#redis.pexpire(this.#slot(tenant, key), this.#pendingMs);
  }

  /** Stores the answer. `fingerprint` may differ from the claim's (an upload's is known only at its end). */
  async complete(tenant: string, key: string, fingerprint: string, answer: Answer): Promise<void> {
    const body = this.#sealer.seal('idempotency', this.#id(tenant, key), 'answer', Buffer.from(answer.body)).toString('base64');
    const entry: Entry = { fp: fingerprint, state: 'done', status: answer.status, type: answer.contentType, body };
    await this.#redis.set(this.#slot(tenant, key), JSON.stringify(entry), 'EX', this.#ttlSeconds);
  }

  /** Frees a claim whose request failed, so that a retry may run. */
  async release(tenant: string, key: string): Promise<void> {
    await this.#redis.del(this.#slot(tenant, key));
  }

  // The key is the client's text: hashed, it makes a fixed-size Redis key and names nothing.
  #id(tenant: string, key: string): string {
    return hash('sha256', `${tenant}\n${key}`, 'hex');
  }

  #slot(tenant: string, key: string): string {
    return this.#keys.idempotency(this.#id(tenant, key));
  }
}

/**
 * Runs `work` once per Idempotency-Key: without the header it just runs; with it, a repeat of
 * the same request gets the stored answer, another request with the key a 409. A failed request
 * frees its key so that it can be retried. The answer is given as `respond` does: status and type
 * set on the reply, the body for the handler to send.
 */
export async function answerOnce(store: IdempotencyStore, request: FastifyRequest, reply: FastifyReply, tenant: string, body: string | Buffer, work: () => Promise<Answer>): Promise<string | Buffer> {
  const key = idempotencyKeyOf(request);
  if (key === undefined) return respond(reply, await work());
  const fingerprint = requestFingerprint(request, body);
  const stored = await store.find(tenant, key, fingerprint);
  if (stored) return replay(reply, stored);
  await store.claim(tenant, key, fingerprint);
  let answer: Answer;
  try {
    answer = await work();
  } catch (err) {
    await store.release(tenant, key).catch(() => {});
    throw err;
  }
  return respondCompleted(store, request, reply, tenant, key, fingerprint, answer);
}

/**
 * Stores the answer of work that has been done, and gives it as `respond` does. The work stands
 * whether or not its answer could be stored (a batch exists, ciphertexts were made), so the
 * caller gets it either way; an answer not stored leaves the key claimed until the claim lapses
 * (pendingMs), so that a retry in the meantime is a 409 and not the work done a second time.
 */
export async function respondCompleted(store: IdempotencyStore, request: FastifyRequest, reply: FastifyReply, tenant: string, key: string, fingerprint: string, answer: Answer): Promise<string | Buffer> {
  try {
    await store.complete(tenant, key, fingerprint, answer);
  } catch (err) {
    request.log.error({ err: { message: (err as Error).message }, status: answer.status }, 'idempotent answer not stored; its key stays claimed until the claim lapses');
  }
  return respond(reply, answer);
}

/** Sets an answer's status and type on the reply and gives its body to send. */
export const respond = (reply: FastifyReply, answer: Answer): string | Buffer => {
  reply.status(answer.status).type(answer.contentType);
  return answer.body;
};

/**
 * Sends what `payload` settles to, or its error through fastify's error handler: the handler
 * returns nothing (fastify's callback style). An async handler that sent its reply and returned
 * it instead would have fastify wait on the response's end (`reply.then`: end-of-stream's listeners
 * on the response, per request), as responses are written at the end of their turn (coalesced-writes.ts);
 * one that sent it and returned nothing would have it sent twice. A rejection that is not an
 * Error is sent as one (a 500: the code here throws Errors). What `reply.send` itself throws is
 * sent as an error too, as fastify does for async handlers, and an error with nowhere to go is
 * logged.
 */
export function sendWhenDone(reply: FastifyReply, payload: Promise<unknown>): void {
  // Both callbacks catch what they meet: no promise is left to reject unhandled.
  payload.then((body) => sendBody(reply, body), (err: unknown) => sendError(reply, err));
}

/** The request of a route whose schema is `S`, as fastify types it in the handler (zod types). */
export type SchemaRequest<S extends FastifySchema> = FastifyRequest<RouteGenericInterface, RawServerDefault, IncomingMessage, S, ZodTypeProvider>;

function sendBody(reply: FastifyReply, body: unknown): void {
  try {
    reply.send(body);
  } catch (err) {
    sendError(reply, err);
  }
}

function sendError(reply: FastifyReply, err: unknown): void {
  if (reply.sent) return logError(reply, err, 'request failed after its answer was sent');
  try {
    reply.send(err instanceof Error ? err : new Error(String(err)));
  } catch (sendFailure) {
    logError(reply, sendFailure, 'an error answer could not be sent');
  }
}

const logError = (reply: FastifyReply, err: unknown, message: string): void => reply.log.error({ err: { message: (err as Error)?.message } }, message);

export const JSON_TYPE = 'application/json; charset=utf-8';

/** An answer of a JSON value. */
export const jsonAnswer = (status: number, value: unknown): Answer => ({ status, contentType: JSON_TYPE, body: JSON.stringify(value) });
