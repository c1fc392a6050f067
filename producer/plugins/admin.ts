import { createBullBoard } from '@bull-board/api';
import { BullMQAdapter } from '@bull-board/api/bullMQAdapter';
import { FastifyAdapter } from '@bull-board/fastify';
import helmet from '@fastify/helmet';
import type { FastifyInstance } from 'fastify';
import { KeyfleetError } from '../../shared/errors.js';
import { deny, hasScope } from './auth.js';

export const ADMIN_PATH = '/admin/queues';

/**
 * Bull Board at /admin/queues for `admin` tokens only. A browser signs in with HTTP Basic (any
 * user name, the token as password). Jobs show batch ids and chunk numbers, never items: chunk
 * inputs live in Redis hashes that the board does not read.
 */
export async function adminRoutes(app: FastifyInstance): Promise<void> {
  // Every route in this encapsulated context, Bull Board's own included, needs the admin scope.
  app.addHook('onRequest', async (request, reply) => {
    if (!request.principal || !hasScope(request.principal, 'admin')) {
      return deny(reply, new KeyfleetError('KF_FORBIDDEN', 'the token lacks the admin scope'));
    }
    return undefined;
  });
  await app.register(helmet, {
    contentSecurityPolicy: {
      directives: {
        defaultSrc: ["'self'"],
        scriptSrc: ["'self'"],
        styleSrc: ["'self'", "'unsafe-inline'", 'https://fonts.googleapis.com'],
        fontSrc: ["'self'", 'https://fonts.gstatic.com', 'data:'],
        imgSrc: ["'self'", 'data:'],
        connectSrc: ["'self'"],
        frameAncestors: ["'none'"],
        formAction: ["'self'"],
        baseUri: ["'self'"],
        // Served over plain HTTP on internal networks too: do not force https sub-requests.
        upgradeInsecureRequests: null,
      },
    },
    referrerPolicy: { policy: 'no-referrer' },
  });
  app.addHook('onSend', async (_request, reply) => {
    reply.header('cache-control', 'no-store');
  });

  const serverAdapter = new FastifyAdapter();
  serverAdapter.setBasePath(ADMIN_PATH);
  createBullBoard({
    queues: [
      new BullMQAdapter(app.services.queue, { description: 'chunks of keyfleet batches' }),
      new BullMQAdapter(app.services.webhookQueue, { description: 'webhook deliveries, one job per batch (retries and give-ups show here)' }),
    ],
    serverAdapter,
    options: { uiConfig: { boardTitle: 'keyfleet' } },
  });
  await app.register(serverAdapter.registerPlugin(), { prefix: ADMIN_PATH });
}
