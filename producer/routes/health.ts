import type { FastifyInstance } from 'fastify';
import { z } from 'zod';
import { KeyfleetError } from '../../shared/errors.js';
import { errorAnswers } from '../plugins/docs.js';

const PING_TIMEOUT_MS = 1_000;
/** /readyz's answer while Redis answers, for the document (the route has no response schema). */
const ready = { description: 'Redis answers', content: { 'application/json': { schema: z.object({ status: z.literal('ready') }) } } };

export async function healthRoutes(app: FastifyInstance): Promise<void> {
  /** Liveness: the process answers. */
  app.get('/healthz', { config: { scope: 'public' }, schema: { tags: ['operations'], summary: 'Liveness: the process answers', security: [] } }, async () => ({ status: 'ok' }));

  /** Readiness: Redis answers within a second. */
  app.get('/readyz', { config: { scope: 'public' }, schema: { tags: ['operations'], summary: 'Readiness: Redis answers within a second (503 when not)', security: [], docs: { responses: { 200: ready, ...errorAnswers('KF_REDIS_UNAVAILABLE') } } } }, async () => {
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
