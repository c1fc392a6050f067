import { UnrecoverableError, Worker, type Job } from 'bullmq';
import { lookup, type LookupAddress } from 'node:dns';
import type { LookupFunction } from 'node:net';
import { Agent, fetch, type Dispatcher } from 'undici';
import { publicStatus, type BatchStore } from '../shared/batch-store.js';
import type { WebhookJobData } from '../shared/queue.js';
import type { ConnectionErrorLog, Redis, RedisKeys } from '../shared/redis.js';
import { TERMINAL_STATUSES } from '../shared/schemas.js';
import { SIGNATURE_HEADER, signWebhook } from '../shared/webhook-signature.js';
import { checkCallbackUrl, isPublicAddress, type WebhookOptions } from '../shared/webhooks.js';

/*
 * Sending webhooks: only the worker process does it (the API enqueues them, shared/webhooks.ts),
 * so the HTTP client (undici) is loaded there and not in the API.
 */

const DEFAULT_TIMEOUT_MS = 5_000;
/** Deliveries in flight per worker process: each mostly waits on a receiver, so a few are cheap. */
const DEFAULT_CONCURRENCY = 4;

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

export interface WebhookWorkerOptions extends WebhookOptions {
  /** Its own connection (`maxRetriesPerRequest: null`); closed with the worker. */
  readonly connection: Redis;
  readonly keys: RedisKeys;
  readonly batches: BatchStore;
  /** The process's log of connection and worker errors. */
  readonly errors: ConnectionErrorLog;
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
  const { connection, keys, batches, secret, errors, concurrency = DEFAULT_CONCURRENCY } = options;
  if (!secret) throw new Error('startWebhookWorker: expected a secret (WEBHOOK_SECRET) to sign with, got none');
  // Without an allow-list, names resolve to their public addresses only (addresses written in
  // the URL are checked by checkCallbackUrl in sendOnce).
  const dispatcher = new Agent(options.allowedHosts.length === 0 ? { connect: { lookup: publicOnlyLookup } } : {});
  const worker = new Worker<WebhookJobData>(keys.webhookQueueName, (job) => sendOnce(job, batches, secret, options, dispatcher), { connection, prefix: keys.prefix, concurrency });
  worker.on('error', (err) => errors.report('webhook-worker', err, 'webhook worker error'));
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
