import { setTimeout as sleep } from 'node:timers/promises';
import type { ErrorCode } from '../shared/errors.js';
import { KeyfleetTimeoutError } from './errors.js';

export interface RetryOptions {
  /** Attempts in all, the first included (default 5). */
  readonly attempts?: number;
  /** The first backoff; it doubles with each retry, with jitter (default 250 ms). */
  readonly baseDelayMs?: number;
  /** No single wait is longer than this, Retry-After included (default 30 s). */
  readonly maxDelayMs?: number;
}

/** The statuses worth retrying: the service asked for patience (429) or is briefly without Redis (503). */
export const RETRYABLE = new Set([429, 503]);

/**
 * A gateway's answers while the API behind it restarts (503 also the API's own, once the
 * retries above ran out): a long wait or download goes on after them, from where it was.
 */
export const GATEWAY_ANSWERS = new Set([502, 503, 504]);

/**
 * How long to wait before attempt `attempt` (1 = the first retry): the server's Retry-After
 * (seconds or an HTTP date) when it sent one, else exponential backoff with full jitter.
 */
export function retryDelayMs(attempt: number, retryAfter: string | null, { baseDelayMs = 250, maxDelayMs = 30_000 }: RetryOptions = {}): number {
  if (retryAfter) {
    const seconds = Number(retryAfter);
    const ms = Number.isFinite(seconds) ? seconds * 1000 : Date.parse(retryAfter) - Date.now();
    if (Number.isFinite(ms)) return Math.min(Math.max(ms, 0), maxDelayMs);
  }
  return Math.min(baseDelayMs * 2 ** (attempt - 1) * (0.5 + Math.random() / 2), maxDelayMs);
}

/**
 * Waits `ms`, ended by `signal` with its reason: as an aborted fetch ends, so that a call aborted
 * during its request and one aborted while it waits to retry reject alike (timers/promises would
 * reject with a generic AbortError instead, the reason only as its cause).
 */
export async function delay(ms: number, signal?: AbortSignal): Promise<void> {
  try {
    await sleep(ms, undefined, signal ? { signal } : {});
  } catch (err) {
    throw signal?.aborted ? signal.reason : err;
  }
}

/**
 * The API's own refusals that mean nothing was done: the request was turned away before any
 * work (no Redis, Redis full, the tenant's or the service's limits). A request that is not safe
 * to send twice may be sent again after one of these, and after nothing else.
 */
export const NOTHING_DONE: ReadonlySet<string> = new Set<ErrorCode>(['KF_REDIS_UNAVAILABLE', 'KF_REDIS_FULL', 'KF_BUSY', 'KF_TOO_MANY_BATCHES', 'KF_BACKLOG_FULL', 'KF_RATE_LIMITED']);

/**
 * Runs `send` until it answers something other than 429/503 or 409 KF_IDEMPOTENCY_IN_PROGRESS,
 * or the attempts run out. `repeatable: false` (a rotation, a deletion) retries a 503 only when
 * it is the API's own refusal of NOTHING_DONE: a gateway's 503 may come after the API did the
 * work, and the work done again is a second rotation. (A 429 is still retried: a gateway's rate
 * limit refuses before it forwards anything.) KF_IDEMPOTENCY_IN_PROGRESS is the API refusing
 * this attempt of a keyed request while an earlier one with the same Idempotency-Key still
 * runs (sent again after a gateway's 503 that came before the API's answer): waited for, as
 * Retry-After asks, it gives that attempt's answer. A request that failed without an answer (a
 * broken connection, a time limit) is not sent again: it may have been done. Except, when it is
 * `idempotent` (it carries an Idempotency-Key, and `send` makes its body anew), one that timed
 * out (KeyfleetTimeoutError), sent again like a 503: the API answers the same key with the first
 * attempt's answer, or 409 KF_IDEMPOTENCY_IN_PROGRESS while that one still runs. `send` is told
 * which attempt it makes (1 = the first). `signal` also ends the wait between attempts.
 */
export async function withRetries(send: (attempt: number) => Promise<Response>, options: RetryOptions = {}, { repeatable = true, idempotent = false, signal }: { repeatable?: boolean; idempotent?: boolean; signal?: AbortSignal } = {}): Promise<Response> {
  const attempts = options.attempts ?? 5;
  for (let attempt = 1; ; attempt++) {
    let res: Response;
    try {
      res = await send(attempt);
    } catch (err) {
      if (!idempotent || !(err instanceof KeyfleetTimeoutError) || attempt >= attempts) throw err;
      await delay(retryDelayMs(attempt, null, options), signal);
      continue;
    }
    if (attempt >= attempts || !(await worthRetrying(res, repeatable))) return res;
    const wait = retryDelayMs(attempt, res.headers.get('retry-after'), options);
    await res.body?.cancel().catch(() => {});
    await delay(wait, signal);
  }
}

/** Whether sending again may give another answer, and cannot do the work twice. */
async function worthRetrying(res: Response, repeatable: boolean): Promise<boolean> {
  if (res.status === 409) return (await apiErrorCode(res)) === 'KF_IDEMPOTENCY_IN_PROGRESS';
  if (!RETRYABLE.has(res.status)) return false;
  if (repeatable || res.status !== 503) return true;
  const code = await apiErrorCode(res);
  return code !== undefined && NOTHING_DONE.has(code);
}

/** The code of `res` if it is the API's own JSON error (read from a clone: `res` stays unread). */
async function apiErrorCode(res: Response): Promise<string | undefined> {
  if (!res.headers.get('content-type')?.startsWith('application/json')) return undefined;
  try {
    const body = (await res.clone().json()) as { error?: { code?: unknown } };
    return typeof body.error?.code === 'string' ? body.error.code : undefined;
  } catch {
    return undefined;
  }
}
