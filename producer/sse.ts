import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { publicStatus } from '../shared/batch-store.js';
import { TERMINAL_STATUSES } from '../shared/schemas.js';

const POLL_MS = 2_000;
const HEARTBEAT_MS = 15_000;

/**
 * Server-Sent Events for one batch: a `progress` event with the status now and after every
 * change (pushed by Redis pub/sub, with a slow poll as a safety net), and a final `done` event
 * carrying the terminal status, after which the stream ends.
 */
export async function streamBatchEvents(app: FastifyInstance, request: FastifyRequest, reply: FastifyReply, batchId: string): Promise<void> {
  const { batches, events, connectionErrors } = app.services;
  reply.hijack();
  const res = reply.raw;
  res.writeHead(200, {
    'content-type': 'text/event-stream; charset=utf-8',
    'cache-control': 'no-cache, no-transform',
    connection: 'keep-alive',
    'x-accel-buffering': 'no',
    'x-request-id': request.id,
  });

  let ended = false;
  let busy = false;
  let again = false;
  /** The last event written: a poll or a message that finds the batch as it was sends nothing. */
  let last = '';
  const timers: NodeJS.Timeout[] = [];
  let unsubscribe = (): void => {};

  const end = (): void => {
    if (ended) return;
    ended = true;
    for (const t of timers) clearInterval(t);
    unsubscribe();
    forgetAtShutdown();
    res.end();
  };
  const forgetAtShutdown = events.onShutdown(end);

  const send = async (): Promise<void> => {
    if (busy) {
      again = true;
      return;
    }
    busy = true;
    try {
      do {
        again = false;
        const record = await batches.get(batchId);
        if (ended) return;
        if (!record) {
          res.write(`event: done\ndata: ${JSON.stringify({ id: batchId, status: 'deleted' })}\n\n`);
          return end();
        }
        const status = publicStatus(record);
        const terminal = TERMINAL_STATUSES.has(status.status);
        const event = `event: ${terminal ? 'done' : 'progress'}\ndata: ${JSON.stringify(status)}\n\n`;
        if (event !== last) res.write(event);
        last = event;
        if (terminal) return end();
      } while (again);
    } catch (err) {
      // Once per message per interval, like failed requests: in a Redis outage every open stream fails alike.
      connectionErrors.report('event-stream', err as Error, 'event stream failed', { reqId: request.id, batchId });
      end();
    } finally {
      busy = false;
    }
  };

  // A client may have gone while the batch was read (a slow Redis): its 'close' came before
  // these listeners, and the stream would go on polling and listening for a dead socket.
  request.raw.on('close', end);
  res.on('close', end);
  if (res.destroyed || request.raw.socket.destroyed) return end();
  // The poll starts at once and does not wait for the SUBSCRIBE: a Redis that does not answer it
  // must not hold the stream (the poll's own read fails, and the stream ends); one that refuses
  // it leaves the stream on the poll alone.
  events.subscribe(batchId, () => void send()).then(
    (stop) => (ended ? stop() : (unsubscribe = stop)),
    (err: Error) => connectionErrors.report('event-stream', err, 'event stream on polling alone: subscribe failed', { reqId: request.id, batchId }),
  );
  timers.push(setInterval(() => void send(), POLL_MS).unref());
  timers.push(setInterval(() => res.write(': keep-alive\n\n'), HEARTBEAT_MS).unref());
  await send();
}
