import rateLimit, { type FastifyRateLimitStore, type FastifyRateLimitStoreCtor } from '@fastify/rate-limit';
import type { FastifyInstance } from 'fastify';
import fp from 'fastify-plugin';
import { KeyfleetError } from '../../shared/errors.js';
import type { Redis } from '../../shared/redis.js';
import { principalOf } from './auth.js';

export interface RateLimitOptions {
  readonly redis: Redis;
  readonly prefix: string;
  /** Requests per second per tenant on the routes that opt in; 0 turns limiting off. */
  readonly perSecond: number;
  /** How often this process and Redis exchange counts; default EXCHANGE_MS. */
  readonly exchangeMs?: number;
}

/** How often each API process adds its counts to Redis's and hears the others'. */
export const EXCHANGE_MS = 20;

/** The limiter's window: a tenant's budget is SYNC_RATE_LIMIT requests in each second. */
const WINDOW_MS = 1_000;

type Increment = Parameters<FastifyRateLimitStore['incr']>[1];

/** One tenant's count in one window (a second of the wall clock, the same for every replica). */
interface Window {
  readonly key: string;
  readonly index: number;
  /** The total in Redis when this process last heard it (its own sent counts included). */
  heard: number;
  /** When this process last exchanged its count, heard or not (0: not yet in this window). */
  exchangedAt: number;
  /** Counted here, on their way to Redis. */
  sending: number;
  /** Counted here since. */
  unsent: number;
}

/**
 * A @fastify/rate-limit store that counts in this process and exchanges counts with Redis, so
 * that no request waits on Redis for its count:
 * - windows are the wall clock's seconds, so every replica counts the same one;
 * - a request counts at once, against what this process last heard from Redis plus what it has
 *   counted since;
 * - one pipeline INCRBYs the counts not yet sent into `{prefix}:rate:{tenant}{group}:{window}`
 *   (expiring soon after the window) and hears the total: at once for a request that finds its
 *   tenant's count `exchangeMs` old or more (a new window's first, one after a pause), else
 *   `exchangeMs` after the last (failed ones too: Redis away costs one attempt per interval).
 * So a replica admits against the others' counts as they were up to `exchangeMs` (plus a round
 * trip) ago, and at a window's start, before its first exchange returns, against none: with R
 * replicas a tenant may get up to R times its limit in that round trip, and while Redis does not
 * answer (each exchange then fails, after up to the client's command timeout) each replica
 * applies the limit alone. One replica alone never passes it.
 */
export class ExchangedCounts implements FastifyRateLimitStore {
  readonly #windows = new Map<string, Window>();
  /** Windows with counts not yet sent. */
  readonly #unsent = new Set<Window>();
  readonly #redis: Redis;
  readonly #namespace: string;
  readonly #windowMs: number;
  readonly #exchangeMs: number;
  #timer: NodeJS.Timeout | undefined;
  #timerAt = 0;
  #exchanging = false;
  #closed = false;

  constructor(redis: Redis, namespace: string, { windowMs, exchangeMs }: { windowMs: number; exchangeMs: number }) {
    this.#redis = redis;
    this.#namespace = namespace;
    this.#windowMs = windowMs;
    this.#exchangeMs = exchangeMs;
  }

  incr(key: string, done: Increment): void {
    const now = Date.now();
    const index = Math.floor(now / this.#windowMs);
    let window = this.#windows.get(key);
    if (window === undefined || window.index !== index) {
      window = { key, index, heard: 0, exchangedAt: 0, sending: 0, unsent: 0 };
      this.#windows.set(key, window); // one per tenant: a past window is replaced, not kept
    }
    if (window.unsent++ === 0) {
      this.#unsent.add(window);
      this.#schedule(Math.max(0, window.exchangedAt + this.#exchangeMs - now));
    }
    done(null, { current: window.heard + window.sending + window.unsent, ttl: (index + 1) * this.#windowMs - now });
  }

  /** Every route here counts in the one shared budget of its `groupId` (the key carries the group). */
  child(options: Parameters<FastifyRateLimitStore['child']>[0]): FastifyRateLimitStore {
    const { groupId, timeWindow } = options as { groupId?: string; timeWindow?: unknown };
    if (groupId === undefined || (timeWindow !== undefined && timeWindow !== this.#windowMs)) {
      throw new Error(`a rate-limited route here needs a groupId and the store's window of ${this.#windowMs} ms`);
    }
    return this;
  }

  close(): void {
    this.#closed = true;
    clearTimeout(this.#timer);
  }

  /** Arms the next exchange, or brings it forward; after the one in flight, if any. */
  #schedule(delay: number): void {
    if (this.#exchanging || this.#closed) return;
    const at = Date.now() + delay;
    if (this.#timer !== undefined) {
      if (at >= this.#timerAt) return;
      clearTimeout(this.#timer);
    }
    this.#timerAt = at;
    this.#timer = setTimeout(() => void this.#exchange(), delay);
    this.#timer.unref();
  }

  async #exchange(): Promise<void> {
    this.#timer = undefined;
    const now = Date.now();
    const sent: Array<[Window, number]> = [];
    const pipeline = this.#redis.pipeline();
    for (const window of this.#unsent) {
      // A window past its end is dropped: its last counts no longer matter.
      if ((window.index + 1) * this.#windowMs <= now) continue;
      const n = window.unsent;
      window.unsent = 0;
      window.sending += n;
      const redisKey = `${this.#namespace}${window.key}:${window.index}`;
      pipeline.incrby(redisKey, n).pexpire(redisKey, this.#windowMs * 2);
      sent.push([window, n]);
    }
    this.#unsent.clear();
    if (sent.length === 0) return;
    this.#exchanging = true;
    const replies = await pipeline.exec().catch(() => null);
    this.#exchanging = false;
    const exchangedAt = Date.now();
    for (const [i, [window, n]] of sent.entries()) {
      window.sending -= n;
      window.exchangedAt = exchangedAt;
      const [err, total] = replies?.[i * 2] ?? [new Error('no reply')];
      // Unheard (or lower than what this process sent: the key was lost), its counts stay its own.
      window.heard = Math.max(window.heard + n, err ? 0 : Number(total));
    }
    // Counts that came in meanwhile: at once for a window not yet exchanged, else after the interval.
    let delay: number | undefined;
    for (const window of this.#unsent) delay = Math.min(delay ?? Infinity, Math.max(0, window.exchangedAt + this.#exchangeMs - exchangedAt));
    if (delay !== undefined) this.#schedule(delay);
  }
}

/** The opt-in of a route: its requests count against the tenant's shared sync budget. */
export const SYNC_RATE_LIMIT = { groupId: 'sync' } as const;

/**
 * Per-tenant rate limits shared by every API replica (@fastify/rate-limit over ExchangedCounts),
 * the sync routes on one budget between them. It runs as a route's onRequest hook, after
 * authentication's (an app-wide onRequest hook, so first) names the tenant, and before the body
 * is read: a tenant over its budget costs the API no body parsing, whatever it sends (up to
 * MAX_BODY_BYTES of JSON, had it waited for the preHandler).
 */
export const rateLimitPlugin = fp(async (app: FastifyInstance, { redis, prefix, perSecond, exchangeMs = EXCHANGE_MS }: RateLimitOptions) => {
  if (perSecond === 0) return;
  const counts = new ExchangedCounts(redis, `${prefix}:rate:`, { windowMs: WINDOW_MS, exchangeMs });
  app.addHook('onClose', async () => counts.close());
  await app.register(rateLimit, {
    global: false,
    store: class {
      constructor() {
        return counts;
      }
    } as unknown as FastifyRateLimitStoreCtor,
    hook: 'onRequest',
    max: perSecond,
    timeWindow: WINDOW_MS,
    keyGenerator: (request) => principalOf(request).tenant,
    errorResponseBuilder: (_request, context) =>
      new KeyfleetError('KF_RATE_LIMITED', `more than ${context.max} requests per second for this tenant; retry after ${context.after}`, {
        retryAfterSeconds: Math.max(1, Math.ceil(context.ttl / 1000)),
      }),
  });
});
