import type { FastifyInstance } from 'fastify';
import { KeyfleetError } from '../../shared/errors.js';

const PING_TIMEOUT_MS = 1_000;

export async function healthRoutes(app: FastifyInstance): Promise<void> {
  /** Liveness: the process answers. */
  app.get('/healthz', { config: { scope: 'public' }, schema: { tags: ['operations'], summary: 'Liveness: the process answers', security: [] } }, async () => ({ status: 'ok' }));

  /** Readiness: Redis answers within a second. */
  app.get('/readyz', { config: { scope: 'public' }, schema: { tags: ['operations'], summary: 'Readiness: Redis answers within a second (503 when not)', security: [] } }, async () => {
    const ping = app.services.redis.ping();
    const timeout = new Promise<never>((_, reject) => setTimeout(() => reject(new Error('timeout')), PING_TIMEOUT_MS).unref());
    try {
      await Promise.race([ping, timeout]);
    } catch (err) {
      ping.catch(() => {});
      throw new KeyfleetError('KF_REDIS_UNAVAILABLE', undefined, { cause: err });
    }
    return { status: 'ready' };
  });
}
