import type { IncomingMessage } from 'node:http';
import type { preParsingHookHandler, RouteOptions } from 'fastify';
import { KeyfleetError } from '../shared/errors.js';

declare module 'fastify' {
  interface FastifyContextConfig {
    /** The route reads its body itself, and bounds the client's pauses itself (uploads). */
    readsOwnBody?: boolean;
  }
}

/**
 * Adds, to every route whose body fastify reads whole, a bound on the client's pauses: a body
 * that sends nothing for `seconds` (UPLOAD_IDLE_SECONDS, as for an upload) is answered 408
 * KF_REQUEST_TIMEOUT, and the error handler closes the connection. Without it a client that
 * stopped half-way through a body held its connection and the part it sent for as long as it
 * liked. fastify reads such bodies as they come, never pausing, so every wait is the client's.
 */
export function boundBodyPauses(route: RouteOptions, seconds: number): void {
  // fastify never reads the body of a GET or HEAD.
  const methods = [route.method].flat();
  if (route.config?.readsOwnBody || methods.every((m) => m === 'GET' || m === 'HEAD')) return;
  const hook: preParsingHookHandler = (request, _reply, payload, done) => {
    const { headers } = request;
    const hasBody = headers['transfer-encoding'] !== undefined || (headers['content-length'] !== undefined && headers['content-length'] !== '0');
    // preParsing runs as the headers arrive, mostly before the body has: `complete` is rarely true.
    if (hasBody && !request.raw.complete) watchPauses(request.raw, seconds);
    done(null, payload);
  };
  route.preParsing = [...[route.preParsing ?? []].flat(), hook];
}

/**
 * Fails `body` with KF_REQUEST_TIMEOUT after `seconds` without a byte, as an 'error' event: what
 * fastify's body reader listens for (a client that goes away is one too). Destroying the request
 * instead would take the socket, and the answer, with it.
 *
 * This is on the path of every sync request, so it is a timer and three listeners, not a stream
 * of its own (a PassThrough per body cost the API 10–25% more CPU per sync request in an A/B
 * run). The 'data' listener starts no flow early: fastify's reader attaches in the same tick.
 */
function watchPauses(body: IncomingMessage, seconds: number): void {
  const alive = (): void => void timer.refresh();
  const done = (): void => {
    clearTimeout(timer);
    body.off('data', alive).off('end', done).off('close', done);
  };
  const timer = setTimeout(() => {
    done();
    // Nobody reading it (the request was answered without its body): nobody to tell.
    if (body.listenerCount('error') === 0) return;
    body.emit('error', new KeyfleetError('KF_REQUEST_TIMEOUT', `the request body sent nothing for ${seconds} s (UPLOAD_IDLE_SECONDS)`));
  }, seconds * 1000);
  body.on('data', alive).once('end', done).once('close', done);
}
