import type { IncomingMessage } from 'node:http';
import type { Socket } from 'node:net';
import type { onRequestHookHandler } from 'fastify';
import { KeyfleetError } from '../shared/errors.js';

/** How long a connection answered before its body ended goes on reading, and dropping, what still arrives. */
const LINGER_MS = 2_000;

/** Connections answered with `connection: close`, lingering: no further request on them runs. */
const closing = new WeakSet<Socket>();

/**
 * The first onRequest hook: a request that arrives on a connection already answered with
 * `connection: close` (pipelined behind the refused body, in the same read as its end) is not
 * run. Its connection closes; it gets no answer, as with Node's own close.
 */
export const refuseOnClosingConnection: onRequestHookHandler = (request, _reply, done) => {
  const socket = request.raw.socket;
  if (!closing.has(socket)) return done();
  socket.destroy();
  done(new KeyfleetError('KF_BAD_REQUEST', 'a request sent behind one answered with connection: close'));
};

/**
 * Has the connection of a request answered before its body ended close in stages (RFC 9112
 * §9.6): once the answer is written, a half-close tells the client it is over, and what the
 * client still sends is read and dropped until the body ends, the client closes, or LINGER_MS
 * passes.
 *
 * Node closes such a connection as soon as the answer is written (`socket.destroySoon`, the
 * last step of an answer sent with `connection: close`). The client, still uploading, then has
 * its next bytes refused with a reset, which can discard the answer before it reads it: a large
 * upload refused early (an unknown key, the tenant's batch limit) reached the CLI as EPIPE or
 * ECONNRESET instead of its 404 or 429, and a 429 was not retried.
 */
export function closeAfterAnswer(request: IncomingMessage): void {
  const socket = request.socket as Socket | undefined;
  // A request made in-process (fastify's inject) has no socket of its own to close.
  if (typeof socket?.destroySoon !== 'function' || closing.has(socket)) return;
  closing.add(socket);
  // The rest of the body is dropped from here on. A route may still hold a reader on it (an
  // upload's iterator, which leaves the request paused once its buffer is full): that read is
  // abandoned, and Node would not drop the body for a request someone reads.
  request.removeAllListeners('readable');
  request.resume();
  const closeNow = socket.destroySoon.bind(socket); // ends the socket, destroys it once the answer is out
  socket.destroySoon = function lingeringClose(): void {
    // Once the body has ended, nothing of the client's is left to drop; what would follow is a
    // request pipelined behind it, which must not run on a connection answered with close (one
    // parsed in the same read as the body's end is stopped by refuseOnClosingConnection).
    if (request.complete) return closeNow();
    if (socket.writable) socket.end();
    const timer = setTimeout(() => socket.destroy(), LINGER_MS);
    timer.unref();
    socket.once('close', () => clearTimeout(timer));
    request.once('end', closeNow);
  };
}
