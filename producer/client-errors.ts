import { STATUS_CODES } from 'node:http';
import type { Socket } from 'node:net';
import type { onRequestHookHandler } from 'fastify';
import { CATALOGUE, KeyfleetError, type ErrorCode } from '../shared/errors.js';

/**
 * Requests so broken that Node's HTTP parser refuses them (malformed request line or framing,
 * oversized headers, a request too slow to arrive) never reach fastify's routes; they still
 * get the error envelope with a stable code, then the connection is closed.
 */
export function clientErrorHandler(err: NodeJS.ErrnoException, socket: Socket): void {
  if (err.code === 'ECONNRESET' || socket.destroyed) return;
  const code: ErrorCode =
    err.code === 'HPE_HEADER_OVERFLOW' ? 'KF_HEADERS_TOO_LARGE' : err.code === 'ERR_HTTP_REQUEST_TIMEOUT' ? 'KF_REQUEST_TIMEOUT' : 'KF_BAD_REQUEST';
  const { status, message } = CATALOGUE[code];
  const body = JSON.stringify({ error: { code, message } });
  if (socket.writable) {
    socket.write(`HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\nContent-Length: ${Buffer.byteLength(body)}\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n${body}`);
  }
  socket.destroy();
}

/**
 * An HTTP/1.1 request must name its Host (RFC 9112 §3.2). Node checks that itself, but answers
 * with a bare 400 and no body; the server is made without that check (`requireHostHeader:
 * false`, app.ts) and an onRequest hook answers such a request in the error envelope instead.
 */
export const refuseWithoutHost: onRequestHookHandler = (request, _reply, done) => {
  const raw = request.raw;
  if (raw.headers.host !== undefined || raw.httpVersionMajor !== 1 || raw.httpVersionMinor === 0) return done();
  done(new KeyfleetError('KF_BAD_REQUEST', 'an HTTP/1.1 request needs a Host header'));
};
