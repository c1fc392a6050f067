import { connect, createServer, type AddressInfo, type Socket } from 'node:net';

export { freePort, portIsFree, redisAnswers, stablePorts, waitForRedis } from '../../scripts/local-net.js';

/** One connection through a `tcpProxy`: the client's socket and the proxy's own to the target. */
export interface ProxiedConnection {
  readonly client: Socket;
  readonly upstream: Socket;
  /** Breaks the connection on both sides at once, as a failed network does. */
  cut(): void;
}

export interface ProxyHandlers {
  /** Bytes from the client; forwarded to the target unless a handler is given (it then decides). */
  fromClient?(data: Buffer, connection: ProxiedConnection): void;
  /** Bytes from the target; forwarded to the client unless a handler is given. */
  fromUpstream?(data: Buffer, connection: ProxiedConnection): void;
}

/**
 * A TCP proxy on loopback to `port`, for tests that break a connection at a chosen moment. A
 * side's end is passed on, and a side's error breaks the other; `close()` breaks every
 * connection still open and stops listening.
 */
export async function tcpProxy(host: string, port: number, handlers: ProxyHandlers = {}): Promise<{ readonly port: number; close(): Promise<void> }> {
  const sockets = new Set<Socket>();
  const server = createServer((client) => {
    const upstream = connect(port, host);
    const connection: ProxiedConnection = { client, upstream, cut: () => (client.destroy(), upstream.destroy()) };
    for (const [socket, other] of [[client, upstream], [upstream, client]] as const) {
      sockets.add(socket);
      socket.on('error', () => other.destroy());
      socket.on('end', () => other.end());
      socket.on('close', () => sockets.delete(socket));
    }
    client.on('data', (data: Buffer) => (handlers.fromClient ? handlers.fromClient(data, connection) : upstream.write(data)));
    upstream.on('data', (data: Buffer) => (handlers.fromUpstream ? handlers.fromUpstream(data, connection) : client.write(data)));
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    port: (server.address() as AddressInfo).port,
    close: async () => {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}
