import { UnrecoverableError, Worker, type Job, type Queue } from 'bullmq';
import ipaddr from 'ipaddr.js';
import { lookup, type LookupAddress } from 'node:dns';
import type { LookupFunction } from 'node:net';
import { Agent, fetch, type Dispatcher } from 'undici';
import { publicStatus, type BatchStore } from './batch-store.js';
import { KeyfleetError } from './errors.js';
import type { Logger } from './logger.js';
import { WEBHOOK_JOB, webhookJobId, type WebhookJobData } from './queue.js';
import type { Redis, RedisKeys } from './redis.js';
import { TERMINAL_STATUSES } from './schemas.js';
import { SIGNATURE_HEADER, signWebhook } from './webhook-signature.js';

export interface WebhookOptions {
  /** WEBHOOK_SECRET; without one, callbacks are refused at batch creation. */
  readonly secret: string | undefined;
  /**
   * WEBHOOK_ALLOWED_HOSTS: host names (or `*.example.com`) callbacks may go to, at any address.
   * Empty: any host, but only at public addresses (publicOnlyLookup).
   */
  readonly allowedHosts: readonly string[];
  readonly logger: Logger;
  /** Attempts per delivery (default 6: about a minute of backoff); set on the job by whoever enqueues it. */
  readonly attempts?: number;
  /** The first backoff, doubling after each failure (default 1 s); set on the job by whoever enqueues it. */
  readonly baseDelayMs?: number;
  /** Time allowed for one attempt (default 5 s); used by the process that sends. */
  readonly timeoutMs?: number;
}

const DEFAULT_ATTEMPTS = 6;
const DEFAULT_BASE_DELAY_MS = 1_000;
const DEFAULT_TIMEOUT_MS = 5_000;
/** Deliveries in flight per worker process: each mostly waits on a receiver, so a few are cheap. */
const DEFAULT_CONCURRENCY = 4;

/**
 * True for a public unicast address. Loopback, private, link-local (where clouds serve instance
 * metadata), unique-local, shared (CGNAT), multicast, reserved and documentation ranges, and
 * IPv6 forms that carry an IPv4 address through a gateway (NAT64, 6to4), are not; an
 * IPv4-mapped IPv6 address counts as its IPv4 address.
 */
export function isPublicAddress(address: string): boolean {
  if (!ipaddr.isValid(address)) return false;
  const parsed = ipaddr.process(address);
  // ipaddr.js counts the deprecated IPv4-compatible form (::a.b.c.d) as unicast.
  if (parsed.kind() === 'ipv6' && parsed.match(IPV4_COMPATIBLE)) return false;
  return parsed.range() === 'unicast';
}

const IPV4_COMPATIBLE = ipaddr.parseCIDR('::/96');

/** A webhook host that resolved to no public address (and is not on WEBHOOK_ALLOWED_HOSTS). */
export class NonPublicAddressError extends Error {
  override readonly name = 'NonPublicAddressError';
}

/**
 * A `lookup` for the connections of webhooks to hosts not on an allow-list: `resolve`'s
 * addresses that are not public are dropped before the connection is made, so a name that
 * resolves (or is rebound) to an internal address cannot reach it. Node makes no lookup for an
 * address written in the URL: checkCallbackUrl refuses those before each delivery.
 */
export const publicOnly = (resolve: typeof lookup): LookupFunction => (hostname, options, callback) => {
  resolve(hostname, { ...options, all: true }, (err: NodeJS.ErrnoException | null, found: LookupAddress[]) => {
    if (err) return callback(err, '', 0);
    const usable = found.filter((a) => isPublicAddress(a.address));
    if (usable.length === 0) return callback(new NonPublicAddressError(`${hostname} resolves to no public address`), '', 0);
    if (options.all) return (callback as unknown as (e: null, all: LookupAddress[]) => void)(null, usable);
    callback(null, usable[0]!.address, usable[0]!.family);
  });
};

/** `dns.lookup`, public addresses only. */
export const publicOnlyLookup: LookupFunction = publicOnly(lookup);

/** Checks a caller's callbackUrl: http(s) only, no credentials, and a host on the allow-list (or, with none, not an internal address). */
export function checkCallbackUrl(text: string, { secret, allowedHosts }: Pick<WebhookOptions, 'secret' | 'allowedHosts'>): string {
  const invalid = (why: string) => new KeyfleetError('KF_CALLBACK_URL_INVALID', `callbackUrl: ${why}`);
  if (!secret) throw invalid('webhooks are not enabled on this service (WEBHOOK_SECRET is not set)');
  let url: URL;
  try {
    url = new URL(text);
  } catch {
    throw invalid('expected an absolute http:// or https:// URL');
  }
  if (url.protocol !== 'http:' && url.protocol !== 'https:') throw invalid(`expected http: or https:, got ${url.protocol}`);
  if (url.username || url.password) throw invalid('credentials in the URL are not accepted');
  const host = url.hostname.toLowerCase();
  const allowed = allowedHosts.length === 0 || allowedHosts.some((h) => (h.startsWith('*.') ? host.endsWith(h.slice(1)) : host === h));
  if (!allowed) throw invalid(`the host ${host} is not in WEBHOOK_ALLOWED_HOSTS`);
  // A name is checked when it is resolved, for each delivery (publicOnlyLookup); an address now.
  const literal = host.startsWith('[') ? host.slice(1, -1) : host;
  if (allowedHosts.length === 0 && ipaddr.isValid(literal) && !isPublicAddress(literal)) {
    throw invalid(`${host} is not a public address (an operator may allow it in WEBHOOK_ALLOWED_HOSTS)`);
  }
  return url.toString();
}

/**
 * Enqueues a batch's webhook. Whichever process sees a batch end calls `deliver`; the job id,
 * derived from the batch id, makes one delivery of it. The job lives in Redis, so its retries
 * survive the process that enqueued it and the one that made the last attempt.
 */
export class WebhookSender {
  readonly #queue: Queue<WebhookJobData>;
  readonly #options: WebhookOptions;
  readonly #inFlight = new Set<Promise<void>>();
  #closing = false;

  /** Takes over `queue` (createWebhookQueue): `close()` closes it. */
  constructor(queue: Queue<WebhookJobData>, options: WebhookOptions) {
    this.#queue = queue;
    this.#options = options;
  }

  /** Enqueues the delivery for a batch that has ended (no-op without a callbackUrl); never throws. */
  deliver(batches: BatchStore, batchId: string): void {
    if (!this.#options.secret || this.#closing) return;
    const run = this.#enqueue(batches, batchId).catch((err: Error) => this.#options.logger.warn({ batchId, err: { message: err.message } }, 'webhook not delivered'));
    this.#inFlight.add(run);
    void run.finally(() => this.#inFlight.delete(run));
  }

  /** Waits for enqueues in progress, then closes the queue. Deliveries stay in Redis for the workers. */
  async close(): Promise<void> {
    this.#closing = true;
    await Promise.allSettled([...this.#inFlight]);
    await this.#queue.close();
  }

  async #enqueue(batches: BatchStore, batchId: string): Promise<void> {
    const record = await batches.get(batchId);
    if (!record?.callbackUrl || !TERMINAL_STATUSES.has(record.status)) return;
    const { attempts = DEFAULT_ATTEMPTS, baseDelayMs = DEFAULT_BASE_DELAY_MS } = this.#options;
    await this.#queue.add(WEBHOOK_JOB, { batchId }, {
      jobId: webhookJobId(batchId),
      attempts,
      // BullMQ waits baseDelayMs · 2^(n−1) after the n-th failure: 1 s, 2 s, 4 s … as before.
      backoff: { type: 'exponential', delay: baseDelayMs },
    });
  }
}

export interface WebhookWorkerOptions extends WebhookOptions {
  /** Its own connection (`maxRetriesPerRequest: null`); closed with the worker. */
  readonly connection: Redis;
  readonly keys: RedisKeys;
  readonly batches: BatchStore;
  /** Deliveries in flight at once in this process (default 4). */
  readonly concurrency?: number;
}

export interface WebhookWorker {
  /** Lets the attempt in flight finish (bounded by timeoutMs); queued and delayed retries stay in Redis. */
  close(): Promise<void>;
}

/**
 * Sends queued webhooks: each job run is one attempt, signed (Keyfleet-Signature), never following
 * redirects. A network error, timeout, 429 or 5xx throws, and BullMQ retries it with the job's
 * backoff; a 2xx, another 4xx (the receiver refused it), a callbackUrl this process's settings
 * do not allow, or a host with no public address (without an allow-list), ends the job.
 */
export function startWebhookWorker(options: WebhookWorkerOptions): WebhookWorker {
  const { connection, keys, batches, secret, logger, concurrency = DEFAULT_CONCURRENCY } = options;
  if (!secret) throw new Error('startWebhookWorker: expected a secret (WEBHOOK_SECRET) to sign with, got none');
  // Without an allow-list, names resolve to their public addresses only (addresses written in
  // the URL are checked by checkCallbackUrl in sendOnce).
  const dispatcher = new Agent(options.allowedHosts.length === 0 ? { connect: { lookup: publicOnlyLookup } } : {});
  const worker = new Worker<WebhookJobData>(keys.webhookQueueName, (job) => sendOnce(job, batches, secret, options, dispatcher), { connection, prefix: keys.prefix, concurrency });
  worker.on('error', (err) => logger.error({ err: { message: err.message } }, 'webhook worker error'));
  return {
    async close() {
      await worker.close();
      await worker.disconnect();
      await dispatcher.close();
    },
  };
}

async function sendOnce(job: Job<WebhookJobData>, batches: BatchStore, secret: string, options: WebhookOptions, dispatcher: Dispatcher): Promise<void> {
  const batchId: unknown = (job.data as Partial<WebhookJobData> | undefined)?.batchId;
  // Not retried: a malformed job never becomes valid.
  if (typeof batchId !== 'string' || !batchId) throw new UnrecoverableError(`expected a webhook job holding a batchId, got ${typeof batchId}`);
  const { logger, timeoutMs = DEFAULT_TIMEOUT_MS } = options;
  const record = await batches.get(batchId);
  if (!record?.callbackUrl || !TERMINAL_STATUSES.has(record.status)) {
    logger.warn({ batchId }, 'webhook not delivered: the batch is gone or has not ended');
    return;
  }
  const log = logger.child({ batchId, webhookHost: new URL(record.callbackUrl).host });
  // Checked again against this process's settings: an allow-list may have changed since the batch was made.
  try {
    checkCallbackUrl(record.callbackUrl, options);
  } catch (err) {
    log.warn({ reason: (err as Error).message }, 'webhook not sent: its callbackUrl is not allowed here');
    return;
  }
  const attempts = job.opts.attempts ?? 1;
  const attempt = job.attemptsMade + 1;
  const body = JSON.stringify(publicStatus(record));
  let outcome: string;
  try {
    const res = await fetch(record.callbackUrl, {
      dispatcher,
      method: 'POST',
      redirect: 'manual',
      signal: AbortSignal.timeout(timeoutMs),
      headers: {
        'content-type': 'application/json',
        'user-agent': 'keyfleet-webhook/1',
        'keyfleet-event': `batch.${record.status}`,
        'keyfleet-delivery': batchId,
        // Signed afresh for each attempt: the timestamp says when this one was sent.
        [SIGNATURE_HEADER]: signWebhook(secret, body),
      },
      body,
    });
    await res.body?.cancel().catch(() => {});
    if (res.status >= 200 && res.status < 300) {
      log.info({ attempt, status: res.status }, 'webhook delivered');
      return;
    }
    if (res.status < 500 && res.status !== 429) {
      log.warn({ attempt, status: res.status }, 'webhook refused by the receiver; not retried');
      return;
    }
    outcome = `HTTP ${res.status}`;
  } catch (err) {
    if ((err as Error).cause instanceof NonPublicAddressError) {
      log.warn({ attempt }, 'webhook not sent: its host resolves to no public address (not retried; WEBHOOK_ALLOWED_HOSTS may allow it)');
      return;
    }
    outcome = (err as Error).name === 'TimeoutError' ? 'timeout' : 'network error';
  }
  log.warn({ attempt, outcome }, 'webhook attempt failed');
  if (attempt >= attempts) log.warn({ attempts }, 'webhook given up');
  // Thrown so that BullMQ retries after the backoff (or, after the last attempt, keeps it as failed).
  throw new Error(`webhook attempt ${attempt} failed: ${outcome}`);
}
