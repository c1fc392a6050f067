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

type Increment = Parameters<FastifyRateLimitStore['incr']>[1];

/** One tenant's count in one window (a second of the wall clock, the same for every replica). */
interface Window {
  readonly key: string;
  readonly index: number;
  /** The total in Redis when this process last heard it (its own sent counts included). */
  heard: number;
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
 * - a tenant's first request in a window, and then every `exchangeMs` while it sends more, one
 *   pipeline INCRBYs the counts not yet sent into `{prefix}:rate:{tenant}{group}:{window}`
 *   (expiring soon after the window) and hears the total.
 * Replicas hear of each other's requests that late (a round trip at a window's start, then up to
 * `exchangeMs`), so with several a tenant may pass its budget by what the others admitted in that
 * time; one replica alone never does. When Redis does not answer, each goes on counting alone.
 */
export class ExchangedCounts implements FastifyRateLimitStore {
  readonly #windows = new Map<string, Window>();
  readonly #redis: Redis;
  readonly #namespace: string;
  readonly #windowMs: number;
  readonly #exchangeMs: number;
  #timer: NodeJS.Timeout | undefined;
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
      window = { key, index, heard: 0, sending: 0, unsent: 0 };
      this.#windows.set(key, window);
      this.#schedule(0); // hear the other replicas' count for the new window now
    } else if (window.unsent === 0) {
      this.#schedule(this.#exchangeMs);
    }
    window.unsent++;
    done(null, { current: window.heard + window.sending + window.unsent, ttl: (index + 1) * this.#windowMs - now });
  }

  /** Routes of one `groupId` share one budget (the key carries the group); every route here has one. */
  child(): FastifyRateLimitStore {
    return this;
  }

  close(): void {
    this.#closed = true;
    clearTimeout(this.#timer);
  }

  /** Arms the next exchange, or brings it forward. */
  #schedule(delay: number): void {
    if (this.#exchanging || this.#closed) return;
    if (this.#timer !== undefined) {
      if (delay > 0) return;
      clearTimeout(this.#timer);
    }
    this.#timer = setTimeout(() => void this.#exchange(), delay);
    this.#timer.unref();
  }

  async #exchange(): Promise<void> {
    this.#timer = undefined;
    const now = Date.now();
    const sent: Array<[Window, number]> = [];
    const pipeline = this.#redis.pipeline();
    for (const window of this.#windows.values()) {
      // A window past its end is forgotten: its last counts no longer matter.
      if ((window.index + 1) * this.#windowMs <= now) this.#windows.delete(window.key);
      // A new window sends its first count; an idle one hears at its next request.
      else if (window.unsent > 0) {
        const n = window.unsent;
        window.unsent = 0;
        window.sending += n;
        const redisKey = `${this.#namespace}${window.key}:${window.index}`;
        pipeline.incrby(redisKey, n).pexpire(redisKey, this.#windowMs * 2);
        sent.push([window, n]);
      }
    }
    if (sent.length === 0) return;
    this.#exchanging = true;
    const replies = await pipeline.exec().catch(() => null);
    this.#exchanging = false;
    sent.forEach(([window, n], i) => {
      window.sending -= n;
      const [err, total] = replies?.[i * 2] ?? [new Error('no reply')];
      // Unheard, the counts stay this process's own knowledge.
      window.heard = err ? window.heard + n : Math.max(window.heard, Number(total));
    });
    if ([...this.#windows.values()].some((w) => w.unsent > 0)) this.#schedule(this.#exchangeMs);
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
  const counts = new ExchangedCounts(redis, `${prefix}:rate:`, { windowMs: 1_000, exchangeMs });
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
    timeWindow: 1_000, // the store's window; the plugin reports it
    keyGenerator: (request) => principalOf(request).tenant,
    errorResponseBuilder: (_request, context) =>
      new KeyfleetError('KF_RATE_LIMITED', `more than ${context.max} requests per second for this tenant; retry after ${context.after}`, {
        retryAfterSeconds: Math.max(1, Math.ceil(context.ttl / 1000)),
      }),
  });
});
