import helmet from '@fastify/helmet';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { KeyfleetError } from '../../shared/errors.js';
import { deny, hasScope } from './auth.js';

export const ADMIN_PATH = '/admin/queues';

/**
 * Bull Board at /admin/queues for `admin` tokens only. A browser signs in with HTTP Basic (any
 * user name, the token as password). Jobs show batch ids and chunk numbers, never items: chunk
 * inputs live in Redis hashes that the board does not read. Read-only unless BULL_BOARD_ACTIONS.
 *
 * The board is loaded on its first request, not at start: its modules (lodash, its templates and
 * static-file serving among them) took 4–10 MB of every API replica's memory at rest, for a page
 * an operator opens now and then (bench/NOTES.md, API peak RSS). Its first page takes a moment longer.
 */
export async function adminRoutes(app: FastifyInstance): Promise<void> {
  // Every route in this encapsulated context (the board's, handed on below) needs the admin scope.
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

  // Bodies go to the board as they came: it parses its own.
  app.removeAllContentTypeParsers();
  app.addContentTypeParser('*', { parseAs: 'buffer' }, (_request, body, done) => done(null, body));

  let board: Promise<FastifyInstance> | undefined;
  app.addHook('onClose', async () => (await board?.catch(() => undefined))?.close());
  const handler = async (request: FastifyRequest, reply: FastifyReply) => {
    board ??= import('./bull-board.js')
      .then(({ buildBoard }) => buildBoard(ADMIN_PATH, { chunks: app.services.queue, webhooks: app.services.webhookQueue }, limitsOf(app), app.keyfleet.bullBoardActions))
      .catch((err: unknown) => {
        board = undefined; // the next request tries again
        throw err;
      });
    const answer = await (await board).inject({
      method: request.method as 'GET',
      url: request.url,
      headers: withoutHopByHop(request.headers),
      ...(Buffer.isBuffer(request.body) ? { payload: request.body } : {}),
    });
    reply.code(answer.statusCode).headers(withoutHopByHop(answer.headers));
    // A HEAD answer has no body but says how long the GET's would be; a 304 has neither.
    if (request.method === 'HEAD' && answer.headers['content-length'] !== undefined) reply.header('content-length', answer.headers['content-length']);
    return answer.rawPayload.length > 0 ? reply.send(answer.rawPayload) : reply.send();
  };
  app.all(ADMIN_PATH, handler);
  app.all(`${ADMIN_PATH}/*`, handler);
}

const HOP_BY_HOP = new Set(['connection', 'keep-alive', 'transfer-encoding', 'content-length']);

function withoutHopByHop<T extends Record<string, unknown>>(headers: T): Record<string, string | string[]> {
  const kept: Record<string, string | string[]> = {};
  for (const [name, value] of Object.entries(headers)) {
    if (value !== undefined && !HOP_BY_HOP.has(name.toLowerCase())) kept[name] = value as string | string[];
  }
  return kept;
}

/** The API's own body and path-parameter limits, for the board to answer as the API would have. */
function limitsOf(app: FastifyInstance): { bodyLimit: number; maxParamLength: number } {
  const { bodyLimit, routerOptions } = app.initialConfig as { bodyLimit?: number; routerOptions?: { maxParamLength?: number } };
  return { bodyLimit: bodyLimit ?? 1024 * 1024, maxParamLength: routerOptions?.maxParamLength ?? 100 };
}
