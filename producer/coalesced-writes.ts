import type { FastifyInstance, onSendAsyncHookHandler } from 'fastify';
import { atEndOfTurn } from './end-of-turn.js';

/**
 * Responses made ready in one turn of the event loop are written together at its end
 * (setImmediate), not each as soon as it is ready.
 *
 * Each write wakes the client's process when it is asleep. A client on the same machine (a
 * sidecar, a node-local proxy, the bench's load generator) that finishes one response before the
 * next is written sleeps and is woken again for every one, and on a virtual machine a wake-up on
 * another CPU is dear. Written in one burst, the responses of a turn wake it once. With the sync
 * path not waiting on Redis (2 cores, autocannon on the same machine, 100 connections; ad hoc),
 * the 10-item encrypt made 19,552–19,776 req/s with a p99 of 10 ms with this, and 13,564–14,063
 * req/s with a p99 of 12–15 ms without; loopback `writev` was 5% of the API's profile samples with
 * it and 27% without (bench/NOTES.md).
 *
 * A response waits for the rest of its turn: the other callbacks of that poll phase, and so behind
 * a large body parsed in the same turn. The hook resolves a promise, so whatever fastify's write
 * throws goes to its error handling as before. Until the write, `reply.sent` is false: an async
 * handler must return what it sends, or the reply (which then waits for the write), or fastify
 * would send a second time; one that sends for itself returns nothing and is not async
 * (sendWhenDone, idempotency.ts).
 */
export function coalesceWrites(app: FastifyInstance): void {
  const hold: onSendAsyncHookHandler = (_request, _reply, payload) => new Promise((resolve) => atEndOfTurn(() => resolve(payload)));
  app.addHook('onSend', hold);
}
