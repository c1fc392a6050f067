import rateLimit from '@fastify/rate-limit';
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

/** The opt-in of a route: its requests count against the tenant's shared sync budget. */
export const SYNC_RATE_LIMIT = { groupId: 'sync' } as const;

/**
 * Per-tenant rate limits counted in Redis (@fastify/rate-limit's Redis store), so every API
 * replica draws on one budget. It runs after authentication (preHandler) to know the tenant.
 * When Redis is down it lets requests through: the sync path needs no Redis, and a limiter
 * should not turn a Redis outage into a full one.
 */
export const rateLimitPlugin = fp(async (app: FastifyInstance, { redis, prefix, perSecond }: RateLimitOptions) => {
  if (perSecond === 0) return;
  await app.register(rateLimit, {
    global: false,
    redis,
    nameSpace: `${prefix}:rate:`,
    hook: 'preHandler',
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
