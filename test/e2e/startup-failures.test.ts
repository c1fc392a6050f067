import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { cpSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { testEnv } from '../helpers/env.js';
import { freePort } from '../helpers/net.js';
import { runEntry, type RunningProcess } from '../helpers/processes.js';

type Entry = 'producer/main.js' | 'worker/main.js';
const NAMES: Record<Entry, string> = { 'producer/main.js': 'keyfleet-api', 'worker/main.js': 'keyfleet-worker' };

/** A process that fails to start should be gone well within this; one still running is killed. */
const EXIT_WITHIN_MS = 15_000;

const { env } = testEnv({ LOG_LEVEL: 'info' });
const running: RunningProcess[] = [];
const held: Server[] = [];

afterAll(async () => {
  await Promise.all(running.map((p) => p.kill()));
  await Promise.all(held.map((s) => new Promise((done) => s.close(done))));
});

/** A port of 127.0.0.1 that this test process holds until the file ends. */
async function takenPort(): Promise<number> {
  const server = createServer();
  held.push(server);
  await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
  return (server.address() as { port: number }).port;
}

interface FailedStart {
  /** The fatal line, parsed. */
  readonly fatal: { level: number; name: string; msg: string; err: { type: string; message: string; code?: string; stack?: string } };
  /** Everything the process wrote, stdout and stderr. */
  readonly output: string;
}

/**
 * Runs an entry that should fail to start and checks what every such failure owes its operator:
 * exit 1 within EXIT_WITHIN_MS, nothing on stderr (no stack trace), every stdout line JSON, and
 * exactly one of them at level fatal (60) saying the process could not start.
 */
async function failedStart(entry: Entry, given: Record<string, string>, dist?: string): Promise<FailedStart> {
  const started = runEntry(entry, { HOST: '127.0.0.1', ...given }, dist);
  running.push(started);
  const killer = setTimeout(() => void started.kill(), EXIT_WITHIN_MS);
  const code = await started.exited;
  clearTimeout(killer);
  const output = started.lines.join('\n');
  expect(started.child.signalCode, `still running after ${EXIT_WITHIN_MS} ms:\n${output}`).toBeNull();
  expect(code, output).toBe(1);
  expect(started.stderr, output).toEqual([]);
  const lines = started.stdout.map((line) => {
    try {
      return JSON.parse(line) as { level: number };
    } catch {
      throw new Error(`a line that is not JSON: ${line}`);
    }
  });
  const fatal = lines.filter((l) => l.level === 60);
  expect(fatal, output).toHaveLength(1);
  expect(fatal[0]).toMatchObject({ name: NAMES[entry], msg: 'could not start' });
  return { fatal: fatal[0] as FailedStart['fatal'], output };
}

describe('a process that cannot start', { timeout: 60_000 }, () => {
  it('an API given a bad setting exits 1 with one fatal JSON line naming the variable and what it got', async () => {
    const { fatal } = await failedStart('producer/main.js', { ...env, PORT: 'abc' });
    expect(fatal.err.type).toBe('ConfigError');
    expect(fatal.err.message).toMatch(/^invalid configuration:\n {2}PORT: .*\(got "abc"\)$/);
    // The message is the whole story: each bad variable, no stack of the parser.
    expect(fatal.err.stack).toBeUndefined();
  });

  it('a worker given a bad setting exits 1 with one fatal JSON line naming the variable and what it got', async () => {
    const { fatal } = await failedStart('worker/main.js', { ...env, WORKER_THREADS: '0' });
    expect(fatal.err).toMatchObject({ type: 'ConfigError' });
    expect(fatal.err.message).toMatch(/WORKER_THREADS: .*\(got "0"\)/);
  });

  it('an unreadable LOG_LEVEL still gets its fatal line, naming it', async () => {
    for (const entry of ['producer/main.js', 'worker/main.js'] as const) {
      const { fatal } = await failedStart(entry, { ...env, LOG_LEVEL: 'loud' });
      expect(fatal.err.message).toMatch(/LOG_LEVEL: .*\(got "loud"\)/);
    }
  });

  it('a bad token list or master key is named, and no secret, good or bad, is written anywhere', async () => {
    const shortToken = randomBytes(6).toString('hex');
    const badKey = randomBytes(20).toString('base64');
    const secrets = [shortToken, badKey, env['KEYFLEET_MASTER_KEY']!, ...env['KEYFLEET_TOKENS']!.split(',').map((entry) => entry.split(':')[1]!)];
    const badTokens = { ...env, KEYFLEET_TOKENS: `${env['KEYFLEET_TOKENS']},globex:${shortToken}` };
    const badMasterKey = { ...env, KEYFLEET_MASTER_KEY: badKey, KEYFLEET_MASTER_KEY_PREVIOUS: env['KEYFLEET_MASTER_KEY']! };
    for (const entry of ['producer/main.js', 'worker/main.js'] as const) {
      const tokens = await failedStart(entry, badTokens);
      expect(tokens.fatal.err.message).toBe('invalid configuration:\n  KEYFLEET_TOKENS: entry 4: expected a token of at least 16 characters');
      const key = await failedStart(entry, badMasterKey);
      expect(key.fatal.err.message).toBe('invalid configuration:\n  KEYFLEET_MASTER_KEY: expected base64 of exactly 32 bytes, got 28 characters decoding to 20 bytes');
      for (const secret of secrets) expect(tokens.output + key.output).not.toContain(secret);
    }
  });

  it('a Redis URL its client cannot parse stops the API and the worker without showing its password', async () => {
    // It passes the configuration's check; the client's URL parser refuses it, and Node's error
    // carries the whole URL as a property that pino's own err serializer would have written.
    const password = `pw${randomBytes(8).toString('hex')}`;
    for (const entry of ['producer/main.js', 'worker/main.js'] as const) {
      const { output } = await failedStart(entry, { ...env, REDIS_URL: `redis://:${password}@[::1` });
      expect(output).not.toContain(password);
    }
  });

  it('a REDIS_URL whose database is not a whole number stops the API and the worker at start, naming REDIS_URL, not later with a stack', async () => {
    // The client read the database with parseInt: /abc crashed the process at its first command
    // (a ReplyError on stderr), /1x quietly used database 1, and one past what Redis can select
    // ran on database 0 after an error line.
    for (const entry of ['producer/main.js', 'worker/main.js'] as const) {
      for (const db of ['abc', '1x', '99999999999']) {
        const { fatal } = await failedStart(entry, { ...env, REDIS_URL: `${env['REDIS_URL']}/${db}` });
        expect(fatal.err.type).toBe('ConfigError');
        expect(fatal.err.message).toBe(`invalid configuration:\n  REDIS_URL: expected the database after the host to be a whole number from 0 to 2147483646, as in redis://host:6379/2 (got ${JSON.stringify(`${env['REDIS_URL']}/${db}`)})`);
      }
    }
  });

  it('an empty REDIS_URL stops the API and the worker at start, naming it, rather than connecting to 127.0.0.1', async () => {
    for (const entry of ['producer/main.js', 'worker/main.js'] as const) {
      const { fatal } = await failedStart(entry, { ...env, REDIS_URL: '' });
      expect(fatal.err.type).toBe('ConfigError');
      expect(fatal.err.message).toMatch(/^invalid configuration:\n {2}REDIS_URL: set but empty: .*\(got ""\)$/);
    }
  });

  it('an API without a token list or a master key exits 1 at once, naming what is missing, all of it in one start', async () => {
    const port = String(await freePort());
    const { KEYFLEET_TOKENS: _tokens, ...noTokens } = env;
    expect((await failedStart('producer/main.js', { ...noTokens, PORT: port })).fatal.err.message).toContain('KEYFLEET_TOKENS: required by the API');
    const { KEYFLEET_MASTER_KEY: _key, ...noKey } = env;
    expect((await failedStart('producer/main.js', { ...noKey, PORT: port })).fatal.err.message).toContain('KEYFLEET_MASTER_KEY: required');
    // Neither, and a bad setting besides: one start names all three.
    const { KEYFLEET_TOKENS: _t, KEYFLEET_MASTER_KEY: _k, ...neither } = env;
    const lines = (await failedStart('producer/main.js', { ...neither, PORT: port, LOG_LEVEL: 'info', WORKER_THREADS: '0' })).fatal.err.message.split('\n');
    expect(lines[0]).toBe('invalid configuration:');
    expect(lines.slice(1).map((l: string) => l.trim().split(':')[0]).sort()).toEqual(['KEYFLEET_MASTER_KEY', 'KEYFLEET_TOKENS', 'WORKER_THREADS']);
  });

  it('a worker without a master key exits 1 at once, naming it', async () => {
    const { KEYFLEET_MASTER_KEY: _key, ...noKey } = env;
    expect((await failedStart('worker/main.js', noKey)).fatal.err.message).toContain('KEYFLEET_MASTER_KEY: required');
  });

  it('an API whose port is taken exits 1 at once with one fatal line saying so, its Redis connections not holding it', async () => {
    const port = await takenPort();
    const { fatal } = await failedStart('producer/main.js', { ...env, PORT: String(port) });
    // The setting to change, without stack traces: they say nothing the message does not.
    expect(fatal.err).toEqual({
      type: 'ConfigError', message: `PORT: port ${port} on 127.0.0.1 is in use: another process listens there; set PORT to a free one`,
      code: 'EADDRINUSE', errno: expect.any(Number), syscall: 'listen', address: '127.0.0.1', port,
    });
  });

  it('a worker whose metrics port is taken exits 1 at once with one fatal line naming WORKER_METRICS_PORT', async () => {
    const port = await takenPort();
    const { fatal } = await failedStart('worker/main.js', { ...env, WORKER_METRICS_PORT: String(port) });
    expect(fatal.err).toEqual({
      type: 'ConfigError', message: `WORKER_METRICS_PORT: port ${port} on 127.0.0.1 is in use: each worker process on one host needs its own WORKER_METRICS_PORT, or 0 for a free one`,
      code: 'EADDRINUSE', errno: expect.any(Number), syscall: 'listen', address: '127.0.0.1', port,
    });
  });

  it('KEYFLEET_KERNEL=native where the addon is not built stops the API and the worker with one fatal line each', async () => {
    // The built code without binding.gyp above it: the addon is not found, as on a machine
    // where it was never built.
    const unbuilt = mkdtempSync(join(tmpdir(), 'keyfleet-unbuilt-'));
    try {
      cpSync(resolve(import.meta.dirname, '..', '..', 'dist'), join(unbuilt, 'dist'), { recursive: true });
      writeFileSync(join(unbuilt, 'package.json'), '{"type":"module"}\n');
      symlinkSync(resolve(import.meta.dirname, '..', '..', 'node_modules'), join(unbuilt, 'node_modules'));
      const port = String(await freePort());
      for (const entry of ['producer/main.js', 'worker/main.js'] as const) {
        const { fatal } = await failedStart(entry, { ...env, PORT: port, KEYFLEET_KERNEL: 'native' }, join(unbuilt, 'dist'));
        expect(fatal.err.message).toContain('KEYFLEET_KERNEL=native, but the native kernel is not built');
      }
    } finally {
      rmSync(unbuilt, { recursive: true, force: true });
    }
  });
});

describe('the master-key rotation tool', () => {
  it('given a bad master key says so in plain words on stderr, exits 1, and shows neither key', () => {
    const badKey = randomBytes(20).toString('base64');
    const script = resolve(import.meta.dirname, '..', '..', 'dist', 'scripts', 'rotate-master-key.js');
    const run = spawnSync(process.execPath, [script], {
      env: { PATH: process.env['PATH'] ?? '', REDIS_URL: env['REDIS_URL']!, KEYFLEET_MASTER_KEY: badKey, KEYFLEET_MASTER_KEY_PREVIOUS: env['KEYFLEET_MASTER_KEY']! },
      encoding: 'utf8',
      timeout: EXIT_WITHIN_MS,
      killSignal: 'SIGKILL',
    });
    expect(run.status, run.stderr).toBe(1);
    // A person runs it: its own words, as for its other failures, not a stack trace nor JSON.
    expect(run.stderr).toBe('rotate-master-key: invalid configuration:\n  KEYFLEET_MASTER_KEY: expected base64 of exactly 32 bytes, got 28 characters decoding to 20 bytes\n');
    expect(run.stdout).toBe('');
    for (const secret of [badKey, env['KEYFLEET_MASTER_KEY']!]) expect(run.stdout + run.stderr).not.toContain(secret);
  });
});
