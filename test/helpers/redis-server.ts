import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { freePort, waitForRedis } from './net.js';

/** A private redis-server with AOF on, that a fault test can kill and start again on the same port and data. */
export interface OwnRedis {
  readonly url: string;
  /** Kills the server (SIGKILL: no goodbye, as a crash or a pulled plug). */
  kill(): Promise<void>;
  /** Starts it again on the same port and data directory; resolves once it answers. */
  start(): Promise<void>;
  /** Stops it answering while its connections stay open (SIGSTOP), as a hung server or a partition. */
  pause(): void;
  /** Lets a paused server go on (SIGCONT). */
  resume(): void;
  /** Stops it and removes its data. */
  close(): Promise<void>;
}

export async function startOwnRedis(): Promise<OwnRedis> {
  const port = await freePort();
  const dir = mkdtempSync(join(tmpdir(), 'keyfleet-fault-redis-'));
  const url = `redis://127.0.0.1:${port}`;
  let server: ChildProcess | undefined;
  // appendfsync always: every acknowledged write survives a SIGKILL, as production's AOF setting
  // promises within a second; the test wants the strict form so its verdict is exact.
  const args = ['--port', String(port), '--bind', '127.0.0.1', '--dir', dir, '--save', '', '--appendonly', 'yes', '--appendfsync', 'always', '--maxmemory-policy', 'noeviction'];
  const kill = async (): Promise<void> => {
    if (!server || server.exitCode !== null || server.signalCode !== null) return;
    const exited = new Promise((done) => server!.once('exit', done));
    server.kill('SIGKILL');
    await exited;
  };
  const start = async (): Promise<void> => {
    server = spawn('redis-server', args, { stdio: 'ignore' });
    await waitForRedis(url, 10_000);
  };
  await start();
  return {
    url,
    kill,
    start,
    pause: () => void server?.kill('SIGSTOP'),
    resume: () => void server?.kill('SIGCONT'),
    async close() {
      server?.kill('SIGCONT');
      await kill();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
