import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { mkdirSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { freePort, portIsFree, stablePorts } from './net.js';

export interface LocalCluster {
  /** Comma-separated seed URLs, as REDIS_URL takes them with REDIS_CLUSTER=true. */
  readonly urls: string;
  stop(): Promise<void>;
}

/** A 3-master Redis Cluster on loopback, built with `redis-server --cluster-enabled yes` and `redis-cli --cluster create`. */
export async function startCluster(): Promise<LocalCluster> {
  const dir = mkdtempSync(join(tmpdir(), 'keyfleet-cluster-'));
  const servers: ChildProcess[] = [];
  const ports: number[] = [];
  const stop = async (): Promise<void> => {
    await Promise.all(
      servers.map((s) => new Promise<void>((done) => (s.exitCode !== null ? done() : (s.once('exit', () => done()), s.kill('SIGTERM'))))),
    );
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    for (let i = 0; i < 3; i++) {
      const port = await portWithFreeBus(ports);
      ports.push(port);
      const nodeDir = join(dir, String(port));
      mkdirSync(nodeDir);
      servers.push(
        spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--cluster-enabled', 'yes', '--cluster-config-file', 'nodes.conf', '--dir', nodeDir, '--save', '', '--appendonly', 'no', '--maxmemory-policy', 'noeviction'], { stdio: 'ignore' }),
      );
    }
    await waitFor(() => ports.every((p) => spawnSync('redis-cli', ['-p', String(p), 'ping']).stdout?.toString().trim() === 'PONG'), 10_000);
    const create = spawnSync('redis-cli', ['--cluster', 'create', ...ports.map((p) => `127.0.0.1:${p}`), '--cluster-replicas', '0', '--cluster-yes']);
    if (create.status !== 0) throw new Error(`redis-cli --cluster create failed: ${create.stdout}${create.stderr}`);
    await waitFor(() => ports.every((p) => spawnSync('redis-cli', ['-p', String(p), 'cluster', 'info']).stdout?.toString().includes('cluster_state:ok')), 20_000);
  } catch (err) {
    await stop();
    throw err;
  }
  return { urls: ports.map((p) => `redis://127.0.0.1:${p}`).join(','), stop };
}

/** A free port whose cluster bus port (port + 10000) is free as well, and neither taken by a node already picked. */
async function portWithFreeBus(taken: readonly number[]): Promise<number> {
  const used = new Set(taken.flatMap((p) => [p, p + 10_000]));
  for (;;) {
    // Its bus port outside the ephemeral range too, where there is room for both.
    const [from, to] = stablePorts();
    const port = await freePort([from, to - 10_000]);
    if (port <= 55_000 && !used.has(port) && !used.has(port + 10_000) && (await portIsFree(port + 10_000))) return port;
  }
}

async function waitFor(check: () => boolean, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`Redis Cluster not ready within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 200));
  }
}
