import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { TestProject } from 'vitest/node';
import { freePort, waitForRedis } from './helpers/net.js';

declare module 'vitest' {
  export interface ProvidedContext {
    redisUrl: string;
  }
}

let server: ChildProcess | undefined;
let dir: string | undefined;

/**
 * Starts a private `redis-server` on a free port with a temp dir for the whole run (so tests
 * never touch a developer's data); falls back to REDIS_URL where no redis-server is installed.
 */
export async function setup(project: TestProject): Promise<void> {
  const hasServer = spawnSync('redis-server', ['--version']).status === 0;
  if (!hasServer) {
    const url = process.env['REDIS_URL'] ?? 'redis://127.0.0.1:6379';
    await waitForRedis(url, 5_000);
    project.provide('redisUrl', url);
    return;
  }
  const port = await freePort();
  dir = mkdtempSync(join(tmpdir(), 'keyfleet-test-redis-'));
  server = spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--dir', dir, '--save', '', '--appendonly', 'no', '--maxmemory-policy', 'noeviction'], { stdio: 'ignore' });
  const url = `redis://127.0.0.1:${port}`;
  await waitForRedis(url, 10_000);
  project.provide('redisUrl', url);
}

export async function teardown(): Promise<void> {
  if (server && server.exitCode === null) {
    const exited = new Promise((done) => server!.once('exit', done));
    server.kill('SIGTERM');
    await exited;
  }
  if (dir) rmSync(dir, { recursive: true, force: true });
}
