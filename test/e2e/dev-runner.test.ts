import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import { createServer, type Server } from 'node:http';
import { resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { testEnv } from '../helpers/env.js';
import { freePort } from '../helpers/net.js';

const script = resolve(import.meta.dirname, '..', '..', 'dist', 'scripts', 'dev.js');
const { env } = testEnv();
const servers: Server[] = [];

afterAll(async () => {
  await Promise.all(servers.map((s) => new Promise((done) => s.close(done))));
});

/** Runs `npm start`'s script until it exits (killed after `withinMs`): its exit code and output. */
function runDev(given: Record<string, string>, withinMs = 20_000, onStdout?: (stdout: string, runner: ChildProcess) => void): Promise<{ code: number | null; stdout: string; stderr: string }> {
  const child = spawn(process.execPath, [script], { env: { PATH: process.env['PATH'] ?? '', ...given }, stdio: ['ignore', 'pipe', 'pipe'] });
  let stdout = '';
  let stderr = '';
  child.stdout.on('data', (piece: Buffer) => {
    stdout += piece.toString();
    onStdout?.(stdout, child);
  });
  child.stderr.on('data', (piece: Buffer) => (stderr += piece.toString()));
  const killer = setTimeout(() => child.kill('SIGKILL'), withinMs);
  return new Promise((done) =>
    child.once('close', (code) => {
      clearTimeout(killer);
      done({ code, stdout, stderr });
    }),
  );
}

describe('npm start (scripts/dev.ts)', { timeout: 60_000 }, () => {
  it('refuses a PORT another service answers on, before starting anything, and prints no banner', async () => {
    // Another checkout’s `npm start`, say: it answers /readyz, so a runner that only waits for
    // readiness would print its banner while its own API failed to listen.
    const other = createServer((_req, res) => res.end('{"status":"ok"}'));
    servers.push(other);
    await new Promise<void>((ok) => other.listen(0, '127.0.0.1', ok));
    const port = String((other.address() as { port: number }).port);

    const run = await runDev({ REDIS_URL: env['REDIS_URL']!, KEYFLEET_MASTER_KEY: env['KEYFLEET_MASTER_KEY']!, KEYFLEET_TOKENS: env['KEYFLEET_TOKENS']!, KEYFLEET_PREFIX: env['KEYFLEET_PREFIX']!, PORT: port, WORKER_METRICS_PORT: '0' });

    expect(run.code, run.stdout + run.stderr).toBe(1);
    expect(run.stdout).not.toContain('keyfleet is running');
    expect(run.stderr).toBe(`keyfleet: port ${port} is taken (another keyfleet running?); set PORT to a free one; stopping\n`);
  });

  it('leaves a PORT that is no port to the processes, which name it, rather than calling it taken', async () => {
    const run = await runDev({ REDIS_URL: env['REDIS_URL']!, KEYFLEET_MASTER_KEY: env['KEYFLEET_MASTER_KEY']!, KEYFLEET_TOKENS: env['KEYFLEET_TOKENS']!, KEYFLEET_PREFIX: env['KEYFLEET_PREFIX']!, PORT: '70000', WORKER_METRICS_PORT: '0' });

    expect(run.code, run.stdout + run.stderr).toBe(1);
    expect(run.stderr).not.toContain('is taken');
    expect(run.stdout).not.toContain('keyfleet is running');
    const fatal = run.stdout.split('\n').filter((line) => line.includes('"level":60')).map((line) => JSON.parse(line) as { name: string; err: { message: string } });
    // The API or the worker (both read PORT), whichever refuses first: the runner then stops the other.
    expect(fatal.length, run.stdout).toBeGreaterThan(0);
    for (const line of fatal) expect(line.err.message).toContain('PORT: Too big: expected number to be <=65535 (got "70000")');
  });

  it('refuses a REDIS_URL that does not answer rather than starting a Redis of its own, without printing its password', async () => {
    const closed = await freePort();
    const run = await runDev({ REDIS_URL: `redis://:hunter2@127.0.0.1:${closed}`, KEYFLEET_MASTER_KEY: env['KEYFLEET_MASTER_KEY']!, KEYFLEET_TOKENS: env['KEYFLEET_TOKENS']!, KEYFLEET_PREFIX: env['KEYFLEET_PREFIX']!, PORT: '0', WORKER_METRICS_PORT: '0' });
    expect(run.code, run.stdout + run.stderr).toBe(1);
    expect(run.stdout).toBe('');
    expect(run.stderr).toBe(`keyfleet: no Redis answers at REDIS_URL (redis://…@127.0.0.1:${closed}): start it or correct the URL, or unset REDIS_URL to have npm start run a redis-server of its own; stopping\n`);
  });

  it('refuses a REDIS_URL that is set but empty, as the API and the worker do, before starting anything', async () => {
    const run = await runDev({ REDIS_URL: '', KEYFLEET_MASTER_KEY: env['KEYFLEET_MASTER_KEY']!, KEYFLEET_TOKENS: env['KEYFLEET_TOKENS']!, KEYFLEET_PREFIX: env['KEYFLEET_PREFIX']!, PORT: '0', WORKER_METRICS_PORT: '0' });

    expect(run.code, run.stdout + run.stderr).toBe(1);
    expect(run.stdout).toBe('');
    expect(run.stderr).toBe('keyfleet: REDIS_URL is set but empty: unset it for redis://127.0.0.1:6379 (or a Redis of its own), or set a URL; stopping\n');
  });

  it('refuses a worker metrics port that is taken before starting anything, rather than printing its banner and stopping', async () => {
    const other = createServer((_req, res) => res.end('# another worker'));
    servers.push(other);
    await new Promise<void>((ok) => other.listen(0, '127.0.0.1', ok));
    const taken = String((other.address() as { port: number }).port);

    const run = await runDev({ REDIS_URL: env['REDIS_URL']!, KEYFLEET_MASTER_KEY: env['KEYFLEET_MASTER_KEY']!, KEYFLEET_TOKENS: env['KEYFLEET_TOKENS']!, KEYFLEET_PREFIX: env['KEYFLEET_PREFIX']!, PORT: String(await freePort()), WORKER_METRICS_PORT: taken });

    expect(run.code, run.stdout + run.stderr).toBe(1);
    expect(run.stdout).toBe('');
    expect(run.stderr).toBe(`keyfleet: the worker's metrics port ${taken} is taken (another keyfleet running?); set WORKER_METRICS_PORT to a free one, or to 0 for any; stopping\n`);
  });

  it('says that a worker which exited 0 on its own was told to stop, then stops the API', async () => {
    let signalled = false;
    const run = await runDev({ REDIS_URL: env['REDIS_URL']!, KEYFLEET_MASTER_KEY: env['KEYFLEET_MASTER_KEY']!, KEYFLEET_TOKENS: env['KEYFLEET_TOKENS']!, KEYFLEET_PREFIX: env['KEYFLEET_PREFIX']!, PORT: String(await freePort()), WORKER_METRICS_PORT: '0' }, 30_000, (stdout, runner) => {
      if (signalled || !stdout.includes('keyfleet is running')) return;
      signalled = true;
      // The runner's worker, as another session's `kill` would find it.
      const worker = execFileSync('ps', ['-o', 'pid=,args=', '--ppid', String(runner.pid)], { encoding: 'utf8' }).split('\n').find((line) => line.includes('worker/main.js'));
      process.kill(Number(worker!.trim().split(' ')[0]), 'SIGTERM');
    });

    expect(signalled, run.stdout + run.stderr).toBe(true);
    expect(run.code, run.stdout + run.stderr).toBe(1);
    expect(run.stderr).toContain('keyfleet worker exited (0: it was sent SIGTERM or SIGINT, and drained); stopping\n');
  });
});
