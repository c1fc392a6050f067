import type { ChildProcess } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { Redis } from 'ioredis';

/** Listens on `port` of 127.0.0.1 (0: one the system picks) and closes again; the port it had. */
function listenOnce(port: number): Promise<number> {
  return new Promise((ok, fail) => {
    const server = createServer();
    server.once('error', fail);
    server.listen(port, '127.0.0.1', () => {
      const bound = (server.address() as { port: number }).port;
      server.close(() => ok(bound));
    });
  });
}

/** The range the system hands out to outgoing connections and to listen(0) (Linux's default where unread). */
function ephemeralRange(): [number, number] {
  try {
    const [low, high] = readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/).map(Number);
    if (Number.isInteger(low) && Number.isInteger(high)) return [low!, high!];
  } catch {
    // not Linux, or no /proc
  }
  return [32_768, 60_999];
}

/**
 * Ports no outgoing connection takes: the widest stretch outside the ephemeral range, from 10000
 * (clear of the well-known and common service ports) to 65535.
 */
export function stablePorts(): [number, number] {
  const [low, high] = ephemeralRange();
  const below: [number, number] = [10_000, low - 1];
  const above: [number, number] = [high + 1, 65_535];
  return below[1] - below[0] >= above[1] - above[0] ? below : above;
}

/**
 * A TCP port that was free a moment ago on 127.0.0.1 (for local servers: dev, tests, bench), in
 * `range` (by default stablePorts()). Picked at random outside the ephemeral range: a port the
 * system picked (listen(0)) may be handed to some process's outgoing connection before the
 * server meant for it binds it (EADDRINUSE), while a port outside the range is only ever taken
 * by a server that asks for it by number.
 */
export async function freePort([from, to]: readonly [number, number] = stablePorts()): Promise<number> {
  // Where the ephemeral range leaves no room (or all of it is taken), one the system picks, race and all.
  for (let tries = 0; to - from >= 100 && tries < 200; tries++) {
    const port = from + Math.floor(Math.random() * (to - from + 1));
    if (await portIsFree(port)) return port;
  }
  return listenOnce(0);
}

/** Whether `port` on 127.0.0.1 was free a moment ago. */
export const portIsFree = (port: number): Promise<boolean> => listenOnce(port).then(() => true, () => false);

/** Whether something listened on `port` of 127.0.0.1 a moment ago (not a port that is not one, nor one this user may not take). */
export const portInUse = (port: number): Promise<boolean> => listenOnce(port).then(() => false, (err: NodeJS.ErrnoException) => err.code === 'EADDRINUSE');

/** True when a Redis at `url` answers PING within about a second. */
export async function redisAnswers(url: string): Promise<boolean> {
  let client: Redis | undefined;
  try {
    // Inside: a URL ioredis cannot read throws here, with the URL (and its password) in the error.
    client = new Redis(url, { lazyConnect: true, connectTimeout: 1_000, maxRetriesPerRequest: 0, retryStrategy: () => null });
    client.on('error', () => {});
    await client.connect();
    return (await client.ping()) === 'PONG';
  } catch {
    return false;
  } finally {
    client?.disconnect();
  }
}

/** Resolves once Redis at `url` answers; rejects after `timeoutMs`. */
export async function waitForRedis(url: string, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await redisAnswers(url))) {
    if (Date.now() > deadline) throw new Error(`Redis at ${url} did not answer within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

const exited = (child: ChildProcess): boolean => child.exitCode !== null || child.signalCode !== null;

/**
 * Resolves once `url` answers 2xx, polling for about 10 s; fails at once if `child`, the process
 * that should answer, exits first (a port taken between freePort() and its bind, say).
 */
export async function waitForOk(url: string, what: string, child?: ChildProcess): Promise<void> {
  for (let i = 0; ; i++) {
    if (child && exited(child)) throw new Error(`${what} exited before it answered (${child.exitCode ?? child.signalCode})`);
    try {
      if ((await fetch(url, { signal: AbortSignal.timeout(1_000) })).ok) return;
    } catch {
      // not listening yet
    }
    if (i > 100) throw new Error(`${what} did not answer at ${url}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

/** Stops a child process: SIGTERM, and SIGKILL if it is still there after 10 s. */
export function stopChild(child: ChildProcess): Promise<void> {
  if (exited(child)) return Promise.resolve();
  return new Promise<void>((done) => {
    const kill = setTimeout(() => child.kill('SIGKILL'), 10_000);
    child.once('exit', () => {
      clearTimeout(kill);
      done();
    });
    child.kill('SIGTERM');
  });
}
