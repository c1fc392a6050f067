import { spawn, type ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { request } from 'node:http';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { Redis } from 'ioredis';
import { API_NODE_FLAGS } from '../producer/node-flags.js';
import { freePort, stopChild, waitForOk, waitForRedis } from '../scripts/local-net.js';

const root = resolve(import.meta.dirname, '..', '..');

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** Peak resident set size of a process so far (VmHWM), in MB. */
export function peakRssMb(pid: number): number {
  const line = readFileSync(`/proc/${pid}/status`, 'utf8').split('\n').find((l) => l.startsWith('VmHWM:'));
  return line ? Number(line.replace(/\D+/g, '')) / 1024 : NaN;
}

/** CPU seconds (user + system) a process has used so far (/proc counts in USER_HZ, 100 on Linux). */
export function cpuSeconds(pid: number): number {
  const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' '); // fields from the third, state
  return (Number(fields[11]) + Number(fields[12])) / 100;
}

export interface Stack {
  readonly url: string;
  readonly token: string;
  readonly redis: Redis;
  readonly api: ChildProcess;
  readonly worker: ChildProcess;
  /** Redis CPU seconds (user + sys) so far. */
  redisCpuSeconds(): Promise<number>;
  stop(): Promise<void>;
}

/** A private redis-server, an API process and one worker process (threads = cores), on loopback. */
export async function startStack(env: Record<string, string> = {}, extraApiFlags: readonly string[] = []): Promise<Stack> {
  const dir = mkdtempSync(join(tmpdir(), 'keyfleet-bench-'));
  const redisPort = await freePort();
  const redisServer = spawn('redis-server', ['--port', String(redisPort), '--bind', '127.0.0.1', '--dir', dir, '--save', '', '--appendonly', 'no'], { stdio: 'ignore' });
  const redisUrl = `redis://127.0.0.1:${redisPort}`;
  try {
    await waitForRedis(redisUrl, 10_000);
  } catch (err) {
    await stopChild(redisServer);
    rmSync(dir, { recursive: true, force: true });
    throw err;
  }
  const redis = new Redis(redisUrl, { retryStrategy: () => 100, maxRetriesPerRequest: null });
  redis.on('error', () => {});
  const token = `bench_${randomBytes(16).toString('hex')}`;
  const port = await freePort();
  const common = {
    PATH: process.env['PATH'] ?? '',
    REDIS_URL: redisUrl,
    KEYFLEET_MASTER_KEY: randomBytes(32).toString('base64'),
    KEYFLEET_TOKENS: `bench:${token}:encrypt+decrypt+rewrap+keys+batches`,
    HOST: '127.0.0.1',
    PORT: String(port),
    WORKER_METRICS_PORT: '0',
    // One tenant stands for many here: the limiter stays on (its counting, and its exchanges
    // with Redis, are part of every sync request's cost) with a budget the load generator never reaches.
    SYNC_RATE_LIMIT: '1000000',
    ...env,
  };
  const api = spawn(process.execPath, [...API_NODE_FLAGS, ...extraApiFlags, join(root, 'dist/producer/main.js')], { env: common, stdio: ['ignore', 'ignore', 'inherit'] });
  const worker = spawn(process.execPath, [join(root, 'dist/worker/main.js')], { env: common, stdio: ['ignore', 'ignore', 'inherit'] });
  const url = `http://127.0.0.1:${port}`;
  const stop = async () => {
    await Promise.all([stopChild(api), stopChild(worker)]);
    redis.disconnect();
    await stopChild(redisServer);
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    await waitForOk(`${url}/readyz`, 'the API', api);
  } catch (err) {
    await stop();
    throw err;
  }
  await sleep(500); // let the worker connect
  return {
    url,
    token,
    redis,
    api,
    worker,
    async redisCpuSeconds() {
      const info = await redis.info('cpu');
      const get = (k: string) => Number(/^(?:\S+):/m.test(info) ? (new RegExp(`^${k}:(\\S+)`, 'm').exec(info)?.[1] ?? 0) : 0);
      return get('used_cpu_sys') + get('used_cpu_user');
    },
    stop,
  };
}

/**
 * One request over node:http; the answer's pieces go to `onPiece` as they arrive, and the status
 * comes back at its end. The bench is also the client of what it measures, and node:http keeps
 * that end light: on Node 24, whole e2e runs took 2.0–2.1 s with fetch as the client and 1.55 s
 * with node:http (ad hoc; on Node 20 the two were even).
 */
export function send(stack: Stack, method: string, path: string, body: { type: string; bytes: Buffer | string } | undefined, onPiece: (piece: Buffer) => void): Promise<number> {
  const headers: Record<string, string | number> = { authorization: `Bearer ${stack.token}` };
  if (body) {
    headers['content-type'] = body.type;
    headers['content-length'] = Buffer.byteLength(body.bytes);
  }
  return new Promise((done, fail) => {
    const req = request(stack.url + path, { method, headers }, (res) => {
      res.on('data', onPiece);
      res.on('error', fail);
      res.on('end', () => done(res.statusCode ?? 0));
    });
    req.on('error', fail);
    req.end(body?.bytes);
  });
}

/** `send`, with the whole answer as text. */
async function exchange(stack: Stack, method: string, path: string, body?: { type: string; bytes: Buffer | string }): Promise<{ status: number; text: string }> {
  const pieces: Buffer[] = [];
  const status = await send(stack, method, path, body, (p) => pieces.push(p));
  return { status, text: Buffer.concat(pieces).toString('utf8') };
}

/** A request with a JSON body, if any; the answer parsed as JSON, whatever its status. */
export async function call(stack: Stack, method: string, path: string, body?: unknown): Promise<any> {
  return JSON.parse((await exchange(stack, method, path, body === undefined ? undefined : { type: 'application/json', bytes: JSON.stringify(body) })).text);
}

/** Uploads NDJSON as a batch (`query`: op, key…); its id. */
export async function uploadBatch(stack: Stack, query: string, ndjson: Buffer | string): Promise<string> {
  const { status, text } = await exchange(stack, 'POST', `/v1/batches?${query}`, { type: 'application/x-ndjson', bytes: ndjson });
  if (status !== 202) throw new Error(`batch upload answered ${status}: ${text.slice(0, 200)}`);
  return (JSON.parse(text) as { batchId: string }).batchId;
}

/** Waits for a batch's final status on its SSE stream (pushed, so no polling load). */
export async function waitForBatch(stack: Stack, id: string): Promise<any> {
  const res = await fetch(`${stack.url}/v1/batches/${id}/events`, { headers: { authorization: `Bearer ${stack.token}` } });
  const text = await res.text(); // the stream ends after the final event
  const last = text.split('\n\n').filter((e) => e.startsWith('event: done')).at(-1);
  if (!last) throw new Error(`batch ${id}: the event stream ended without a final status`);
  return JSON.parse(last.slice(last.indexOf('data: ') + 6));
}

/** Downloads a batch's results, counting lines without holding them. */
export async function downloadResults(stack: Stack, id: string): Promise<{ lines: number; bytes: number }> {
  let lines = 0;
  let bytes = 0;
  const status = await send(stack, 'GET', `/v1/batches/${id}/results`, undefined, (piece) => {
    bytes += piece.length;
    for (let i = piece.indexOf(10); i !== -1; i = piece.indexOf(10, i + 1)) lines++;
  });
  if (status !== 200) throw new Error(`batch ${id}: results answered ${status}`);
  return { lines, bytes };
}
