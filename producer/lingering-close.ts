import type { Socket } from 'node:net';

/** How long a connection answered before its body ended goes on reading, and dropping, what still arrives. */
export const LINGER_MS = 2_000;

const lingering = new WeakSet<Socket>();

/**
 * Has the connection of a request answered before its body ended close in stages (RFC 9112
 * §9.6): once the answer is written, a half-close tells the client it is over, and what the
 * client still sends is read and dropped until it closes too, or for `lingerMs` at most.
 *
 * Node closes such a connection as soon as the answer is written (`socket.destroySoon`, the
 * last step of an answer sent with `connection: close`). The client, still uploading, then has
 * its next bytes refused with a reset, which can discard the answer before it reads it: a large
 * upload refused early (an unknown key, the tenant's batch limit) reached the CLI as EPIPE or
 * ECONNRESET instead of its 404 or 429, and a 429 was not retried.
 */
export function closeAfterAnswer(socket: Socket, lingerMs = LINGER_MS): void {
  if (lingering.has(socket)) return;
  lingering.add(socket);
  // Node's HTTP server calls this once the answer is written; the parser still reads the socket
  // (the request's remaining body is dumped), so the client's bytes are taken and dropped.
  socket.destroySoon = function lingeringClose(this: Socket): void {
    if (this.writable) this.end();
    const timer = setTimeout(() => this.destroy(), lingerMs);
    timer.unref();
    this.once('close', () => clearTimeout(timer));
  };
}
