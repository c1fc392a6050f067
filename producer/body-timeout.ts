import type { IncomingMessage } from 'node:http';
import type { Readable } from 'node:stream';
import type { preParsingHookHandler } from 'fastify';
import { KeyfleetError } from '../shared/errors.js';
import type { BodyBudget } from './body-budget.js';

declare module 'fastify' {
  interface FastifyContextConfig {
    /** The route reads its body itself, and bounds the client's pauses itself (uploads). */
    readsOwnBody?: boolean;
  }
}

/**
 * A preParsing hook, for every request (the 404 handler's too: fastify reads its body as
 * well): a body that sends nothing for `seconds` (UPLOAD_IDLE_SECONDS, as for an upload) is
 * answered 408 KF_REQUEST_TIMEOUT, and the error handler closes the connection. Without it a
 * client that stopped half-way through a body held its connection and the part it sent for as
 * long as it liked. fastify reads such bodies as they come, never pausing, so every wait is the
 * client's.
 *
 * It must stay the last preParsing hook (it is the only one): fastify's body reader has to
 * attach in the same tick as the watch's 'data' listener, which sets the body flowing.
 */
export function bodyPauseLimit(seconds: number, budget: BodyBudget): preParsingHookHandler {
  return (request, reply, payload, done) => {
    const { headers, raw } = request;
    const hasBody = headers['transfer-encoding'] !== undefined || (headers['content-length'] !== undefined && headers['content-length'] !== '0');
    // preParsing runs as the headers arrive, mostly before the body has: `complete` is rarely true
    // (a chunked body that is, came in the headers' read: small, and not counted).
    if (hasBody && !raw.complete && !request.routeOptions.config?.readsOwnBody) watchPauses(payload, raw, seconds, budget.chunkCounter(reply));
    done(null, payload);
  };
}

/**
 * Fails `body` with KF_REQUEST_TIMEOUT after `seconds` without a byte, as an 'error' event: what
 * fastify's body reader listens for (a client that goes away is one too). Destroying the request
 * instead would take the socket, and the answer, with it. A body nobody reads any more (the
 * request was answered without it) only holds its connection: that is closed.
 *
 * This is on the path of every sync request, so it is a timer and a few listeners, not a stream
 * of its own (a PassThrough per body cost the API 10–25% more CPU per sync request in an A/B
 * run).
 */
function watchPauses(body: Readable, request: IncomingMessage, seconds: number, count?: (bytes: number) => KeyfleetError | undefined): void {
  const socket = request.socket;
  const fail = (err: KeyfleetError): void => {
    stop();
    if (body.listenerCount('error') > 0) body.emit('error', err);
    else socket.destroy();
  };
  // A chunked body is also counted against the bodies held at once (BodyBudget), piece by piece.
  const alive = count
    ? (piece: Buffer): void => {
        timer.refresh();
        const over = count(piece.length);
        if (over) fail(over);
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
