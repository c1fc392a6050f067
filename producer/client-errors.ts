import { STATUS_CODES } from 'node:http';
import type { Socket } from 'node:net';
import { CATALOGUE, type ErrorCode } from '../shared/errors.js';

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
