import { createBullBoard } from '@bull-board/api';
import { BullMQAdapter } from '@bull-board/api/bullMQAdapter';
import { FastifyAdapter } from '@bull-board/fastify';
import type { Queue } from 'bullmq';
import Fastify, { type FastifyInstance } from 'fastify';

/**
 * Bull Board over the chunk and webhook queues, served by a fastify instance of its own that
 * listens nowhere: the API hands it each admin request (plugins/admin.ts). Its routes live under
 * `basePath`, as the pages it renders expect; its body and path limits are the API's. Without
 * `actions` (BULL_BOARD_ACTIONS) it is read-only: the board hides its buttons and answers every
 * action 405.
 */
export async function buildBoard(basePath: string, queues: { chunks: Queue; webhooks: Queue }, limits: { bodyLimit: number; maxParamLength: number }, actions: boolean): Promise<FastifyInstance> {
  const board = Fastify({ logger: false, bodyLimit: limits.bodyLimit, routerOptions: { maxParamLength: limits.maxParamLength } });
  try {
    const serverAdapter = new FastifyAdapter();
    serverAdapter.setBasePath(basePath);
    createBullBoard({
      queues: [
        new BullMQAdapter(queues.chunks, { description: 'chunks of keyfleet batches', readOnlyMode: !actions }),
        new BullMQAdapter(queues.webhooks, { description: 'webhook deliveries, one job per batch (retries and give-ups show here)', readOnlyMode: !actions }),
      ],
      serverAdapter,
      options: { uiConfig: { boardTitle: 'keyfleet' } },
    });
    await board.register(serverAdapter.registerPlugin(), { prefix: basePath });
    await board.ready();
    return board;
  } catch (err) {
    await board.close().catch(() => {});
    throw err;
  }
}
