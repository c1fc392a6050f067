import rateLimit, { type FastifyRateLimitStore, type FastifyRateLimitStoreCtor } from '@fastify/rate-limit';
import { createRequire } from 'node:module';
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
}

// The plugin's own Redis store (a Lua INCR + PEXPIRE per request), not in its typed exports.
type RedisStoreCtor = new (continueExceeding: boolean, exponentialBackoff: boolean, redis: Redis, key: string) => FastifyRateLimitStore;
const RedisStore = createRequire(import.meta.url)('@fastify/rate-limit/store/RedisStore.js') as RedisStoreCtor;

/**
 * The plugin's Redis store, except that routes of one `groupId` share one budget: its own
 * store keys every route apart (method and URL), so the three sync routes would each get the
 * whole limit. The request key already carries the group.
 */
function groupedRedisStore(redis: Redis, namespace: string): FastifyRateLimitStoreCtor {
  class GroupedRedisStore extends RedisStore {
    override child(options: Parameters<FastifyRateLimitStore['child']>[0]): FastifyRateLimitStore {
      return (options as { groupId?: string }).groupId ? this : super.child(options);
    }
  }
  return class {
    constructor() {
      return new GroupedRedisStore(false, false, redis, namespace);
    }
  } as unknown as FastifyRateLimitStoreCtor;
}

/** The opt-in of a route: its requests count against the tenant's shared sync budget. */
export const SYNC_RATE_LIMIT = { groupId: 'sync' } as const;

/**
 * Per-tenant rate limits counted in Redis (@fastify/rate-limit's Redis store), so every API
 * replica draws on one budget, and the sync routes on one budget between them. It runs as a
 * route's onRequest hook, after authentication's (an app-wide onRequest hook, so first) names the
 * tenant, and before the body is read: a tenant over its budget costs the API no body parsing,
 * whatever it sends (up to MAX_BODY_BYTES of JSON, had it waited for the preHandler).
 * When Redis is down it lets requests through: the sync path goes on with the keys it has
 * cached, and a limiter should not turn a Redis outage into a full one.
 */
export const rateLimitPlugin = fp(async (app: FastifyInstance, { redis, prefix, perSecond }: RateLimitOptions) => {
  if (perSecond === 0) return;
  await app.register(rateLimit, {
    global: false,
    store: groupedRedisStore(redis, `${prefix}:rate:`),
    hook: 'onRequest',
    max: perSecond,
    timeWindow: 1_000,
    skipOnError: true,
    keyGenerator: (request) => principalOf(request).tenant,
    errorResponseBuilder: (_request, context) =>
      new KeyfleetError('KF_RATE_LIMITED', `more than ${context.max} requests per second for this tenant; retry after ${context.after}`, {
        retryAfterSeconds: Math.max(1, Math.ceil(context.ttl / 1000)),
      }),
  });
});
