import { setTimeout as sleep } from 'node:timers/promises';
import { publicStatus, type BatchStore } from './batch-store.js';
import { KeyfleetError } from './errors.js';
import type { Logger } from './logger.js';
import { TERMINAL_STATUSES } from './schemas.js';
import { SIGNATURE_HEADER, signWebhook } from './webhook-signature.js';

export interface WebhookOptions {
  /** WEBHOOK_SECRET; without one, callbacks are refused at batch creation. */
  readonly secret: string | undefined;
  /** WEBHOOK_ALLOWED_HOSTS: host names (or `*.example.com`) callbacks may go to; empty = any. */
  readonly allowedHosts: readonly string[];
  readonly logger: Logger;
  /** Attempts per delivery (default 6: about a minute of backoff). */
  readonly attempts?: number;
  /** The first backoff, doubling after each failure (default 1 s). */
  readonly baseDelayMs?: number;
  /** Time allowed for one attempt (default 5 s). */
  readonly timeoutMs?: number;
}

/** Checks a caller's callbackUrl: http(s) only, no credentials, and a host on the allow-list. */
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
  return url.toString();
}

/**
 * Delivers a batch's final status to its callbackUrl, signed (Keyfleet-Signature), retried with
 * backoff on network errors, 429 and 5xx, never following redirects. Whichever process sees a
 * batch end calls `deliver`; a claim in Redis makes one of them send it.
 */
export class WebhookSender {
  readonly #options: WebhookOptions;
  readonly #inFlight = new Set<Promise<void>>();
  readonly #closing = new AbortController();

  constructor(options: WebhookOptions) {
    this.#options = options;
  }

  /** Starts the delivery for a batch that has ended (no-op without a callbackUrl); never throws. */
  deliver(batches: BatchStore, batchId: string): void {
    if (!this.#options.secret || this.#closing.signal.aborted) return;
    const run = this.#deliver(batches, batchId).catch((err: Error) => this.#options.logger.warn({ batchId, err: { message: err.message } }, 'webhook not delivered'));
    this.#inFlight.add(run);
    void run.finally(() => this.#inFlight.delete(run));
  }

  /** Stops retrying and waits for attempts in progress. */
  async close(): Promise<void> {
    this.#closing.abort();
    await Promise.allSettled([...this.#inFlight]);
  }

  async #deliver(batches: BatchStore, batchId: string): Promise<void> {
    const record = await batches.get(batchId);
    if (!record?.callbackUrl || !TERMINAL_STATUSES.has(record.status)) return;
    if (!(await batches.claimWebhook(batchId))) return; // another process sends it
    const { secret, logger, attempts = 6, baseDelayMs = 1_000, timeoutMs = 5_000 } = this.#options;
    const body = JSON.stringify(publicStatus(record));
    const log = logger.child({ batchId, webhookHost: new URL(record.callbackUrl).host });
    for (let attempt = 1; attempt <= attempts; attempt++) {
      let outcome: string;
      try {
        const res = await fetch(record.callbackUrl, {
          method: 'POST',
          redirect: 'manual',
          signal: AbortSignal.any([AbortSignal.timeout(timeoutMs), this.#closing.signal]),
          headers: {
            'content-type': 'application/json',
            'user-agent': 'keyfleet-webhook/1',
            'keyfleet-event': `batch.${record.status}`,
            'keyfleet-delivery': batchId,
            // Signed afresh for each attempt: the timestamp says when this one was sent.
            [SIGNATURE_HEADER]: signWebhook(secret!, body),
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
        if (this.#closing.signal.aborted) return;
        outcome = (err as Error).name === 'TimeoutError' ? 'timeout' : 'network error';
      }
      log.warn({ attempt, outcome }, 'webhook attempt failed');
      if (attempt < attempts) await sleep(baseDelayMs * 2 ** (attempt - 1), undefined, { signal: this.#closing.signal }).catch(() => {});
      if (this.#closing.signal.aborted) return;
    }
    log.warn({ attempts }, 'webhook given up');
  }
}
