import type { IncomingMessage } from 'node:http';
import type { Readable } from 'node:stream';
import type { preParsingHookHandler } from 'fastify';
import { KeyfleetError } from '../shared/errors.js';
import type { BodyBudget, BodyRefusal } from './body-budget.js';
import { atEndOfTurn } from './end-of-turn.js';

declare module 'fastify' {
  interface FastifyContextConfig {
    /** The route reads its body itself, and bounds the client's pauses itself (uploads). */
    readsOwnBody?: boolean;
  }
}

const TENANT_BUSY = "the tenant's requests hold as many request bodies as one tenant may at once on this API; retry shortly";
const busy = (bound: BodyRefusal): KeyfleetError => new KeyfleetError('KF_BUSY', bound === 'tenant' ? TENANT_BUSY : undefined, { retryAfterSeconds: 1 });

/**
 * A preParsing hook, for every request with a body (the 404 handler's too: fastify reads its
 * body as well), before the body is read and after authentication and the rate limit:
 * - the body is counted against the bodies held at once (`budget`, MAX_BODY_BYTES_IN_FLIGHT, and
 *   its tenant's share, MAX_TENANT_BODY_BYTES_IN_FLIGHT): by its Content-Length now, refused 503
 *   KF_BUSY with Retry-After when it would pass either bound; a
 *   chunked one piece by piece as it arrives, failing KF_BUSY at the piece that passes it (one
 *   already whole, by its bytes now);
 * - a body that sends nothing for `seconds` (UPLOAD_IDLE_SECONDS, as for an upload) is answered
 *   408 KF_REQUEST_TIMEOUT, and the error handler closes the connection. Without it a client
 *   that stopped half-way through a body held its connection and the part it sent for as long as
 *   it liked. fastify reads such bodies as they come, never pausing, so every wait is the client's.
 * Routes that read their own bodies (uploads, streamed into chunks) bound their pauses themselves
 * and hold no whole body: neither applies.
 *
 * It must stay the last preParsing hook (it is the only one): fastify's body reader has to
 * attach in the same tick as a chunked body's watch, whose 'data' listener sets the body flowing.
 */
export function watchBodies(seconds: number, budget: BodyBudget): preParsingHookHandler {
  return (request, reply, payload, done) => {
    const { headers, raw } = request;
    const chunked = headers['transfer-encoding'] !== undefined;
    const declared = headers['content-length'];
    if ((!chunked && (declared === undefined || declared === '0')) || request.routeOptions.config?.readsOwnBody) return done(null, payload);
    const res = reply.raw;
    // preParsing runs as the headers arrive, mostly before the body has. The pieces of a chunked
    // body already in still flow to the watch's 'data' listener, so it counts them with the rest;
    // but one that came whole with its headers (in their socket read, up to 64 KB) gets no watch:
    // its bytes are all buffered, and counted now.
    // Counted for its tenant too ('' before authentication: the 404 handler's, the public routes').
    const refused = budget.reserve(res, chunked ? (raw.complete ? raw.readableLength : 0) : Number(declared) || 0, request.principal?.tenant ?? '');
    if (refused) return done(busy(refused));
    // A small body mostly comes in the same socket read as its headers, and this hook runs while
    // they are parsed, before it: a body of known length (its bytes reserved already, so no piece
    // of it needs to be seen) is watched from the end of the turn, if it is not whole by then.
    // Watched at once, every sync request had a timer and three listeners for nothing (1–2 µs).
    if (chunked && !raw.complete) watchPauses(payload, raw, seconds, (bytes) => budget.grow(res, bytes));
    else if (!raw.complete) atEndOfTurn(() => void (raw.complete || raw.socket.destroyed || watchPauses(payload, raw, seconds)));
    done(null, payload);
  };
}

/**
 * Fails `body` with KF_REQUEST_TIMEOUT after `seconds` without a byte (or KF_BUSY at a piece
 * `count` refuses), as an 'error' event: what
 * fastify's body reader listens for (a client that goes away is one too). Destroying the request
 * instead would take the socket, and the answer, with it. A body nobody reads any more (the
 * request was answered without it) only holds its connection: that is closed.
 *
 * This is on the path of every sync request, so it is a timer and a few listeners, not a stream
 * of its own (a PassThrough per body cost the API 10–25% more CPU per sync request in an A/B
 * run).
 */
function watchPauses(body: Readable, request: IncomingMessage, seconds: number, count?: (bytes: number) => BodyRefusal | undefined): void {
  const socket = request.socket;
  const fail = (err: KeyfleetError): void => {
    stop();
    if (body.listenerCount('error') > 0) body.emit('error', err);
    else socket.destroy();
  };
  // A chunked body is also counted against the bodies held at once, piece by piece.
  const alive = count
    ? (piece: Buffer): void => {
        timer.refresh();
        const refused = count(piece.length);
        if (refused) fail(busy(refused));
      }
    : (): void => void timer.refresh();
  const stop = (): void => {
    clearTimeout(timer);
    body.off('data', alive).off('end', stop);
    socket.off('close', stop);
  };
  const timer = setTimeout(() => fail(new KeyfleetError('KF_REQUEST_TIMEOUT', `the request body sent nothing for ${seconds} s (UPLOAD_IDLE_SECONDS)`)), seconds * 1000);
  body.on('data', alive).once('end', stop);
  socket.once('close', stop);
}
