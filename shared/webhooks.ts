import type { Queue } from 'bullmq';
import ipaddr from 'ipaddr.js';
import type { BatchStore } from './batch-store.js';
import { KeyfleetError } from './errors.js';
import type { Logger } from './logger.js';
import { WEBHOOK_JOB, webhookJobId, type WebhookJobData } from './queue.js';
import { TERMINAL_STATUSES } from './schemas.js';

export interface WebhookOptions {
  /** WEBHOOK_SECRET; without one, callbacks are refused at batch creation. */
  readonly secret: string | undefined;
  /**
   * WEBHOOK_ALLOWED_HOSTS: host names (or `*.example.com`) callbacks may go to, at any address.
   * Empty: any host, but only at public addresses (worker/webhook-delivery.ts, publicOnlyLookup).
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

  /** Enqueues the delivery for a batch that has ended (no-op without a callbackUrl); never throws, a failure is logged. */
  deliver(batches: BatchStore, batchId: string): void {
    this.enqueue(batches, batchId).catch((err: Error) => this.#options.logger.warn({ batchId, err: { message: err.message } }, 'webhook not delivered'));
  }

  /**
   * Enqueues the delivery for a batch that has ended (no-op without a callbackUrl); rejects
   * when Redis refuses it, for a caller that can try again: a chunk's job, whose rerun announces
   * its batch's end again.
   */
  enqueue(batches: BatchStore, batchId: string): Promise<void> {
    if (this.#closing) return Promise.resolve();
    const enqueued = this.#enqueue(batches, batchId);
    // Without a secret only a warning is at stake, not worth a chunk's rerun: its failure goes unsaid.
    const run = this.#options.secret ? enqueued : enqueued.catch(() => {});
    const settled = run.catch(() => {});
    this.#inFlight.add(settled);
    void settled.finally(() => this.#inFlight.delete(settled));
    return run;
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
    // Without a secret nothing can be signed, so nothing is sent; a batch that asked for a
    // webhook (its API had the secret, this process has not) is said so, not passed over.
    if (!this.#options.secret) {
      this.#options.logger.warn({ batchId, webhookHost: new URL(record.callbackUrl).host }, 'webhook not sent: WEBHOOK_SECRET is not set here (the API and every worker need the same one)');
      return;
    }
    const { attempts = DEFAULT_ATTEMPTS, baseDelayMs = DEFAULT_BASE_DELAY_MS } = this.#options;
    await this.#queue.add(WEBHOOK_JOB, { batchId }, {
      jobId: webhookJobId(batchId),
      attempts,
      // BullMQ waits baseDelayMs · 2^(n−1) after the n-th failure: 1 s, 2 s, 4 s … as before.
      backoff: { type: 'exponential', delay: baseDelayMs },
    });
  }
}
