import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import http from 'node:http';
import { setTimeout as sleep } from 'node:timers/promises';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { buildApp } from '../../producer/app.js';
import { Client } from '../helpers/client.js';
import { configFrom, testEnv } from '../helpers/env.js';
import { startApi, startWorker, type RunningProcess } from '../helpers/processes.js';
import { startOwnRedis, type OwnRedis } from '../helpers/redis-server.js';

// Every fault here is real: processes get SIGKILL, Redis is killed and started again on its
// AOF. Each test ends with a verdict on every item, and on the logs holding no secret.

const serial = (n: number) => `FAULT-${String(n).padStart(7, '0')}-${(n * 7919) % 100_003}`;
const running: RunningProcess[] = [];
let ownRedis: OwnRedis;

beforeAll(async () => {
  ownRedis = await startOwnRedis();
});
afterAll(async () => {
  await Promise.all(running.map((p) => p.stop(5_000)));
  await ownRedis?.close();
});

async function stack(overrides: Record<string, string>) {
  const made = testEnv({ REDIS_URL: ownRedis.url, ...overrides });
  const api = await startApi(made.env);
  running.push(api); // stopped in afterAll even if the worker fails to start
  const worker = await startWorker(made.env);
  running.push(worker);
  const client = new Client(api.url, made.admin.token);
  expect((await client.json('POST', '/v1/keys/serials')).status).toBe(201);
  return { ...made, api, worker, client, port: api.port };
}

async function statusOf(client: Client, id: string): Promise<any> {
  return (await client.json('GET', `/v1/batches/${id}`)).body;
}

/** Every item once, in order, and each decrypts back to its original (via a second batch). */
async function expectExactlyOnce(client: Client, id: string, originals: string[]): Promise<void> {
  const done = await client.waitForBatch(id);
  expect(done).toMatchObject({ status: 'completed', total: originals.length, processed: originals.length, succeeded: originals.length, failed: 0 });
  const lines = await client.results(id);
  expect(lines).toHaveLength(originals.length);
  lines.forEach((l, n) => expect(l.i).toBe(n));
  expect(new Set(lines.map((l) => l.ciphertext)).size).toBe(originals.length);
  const back = await client.uploadNdjson('decrypt', 'serials', lines.map((l) => l.ciphertext!));
  await client.waitForBatch(back.body.batchId);
  expect((await client.results(back.body.batchId)).map((l) => l.plaintext)).toEqual(originals);
}

function expectNoSecrets(processes: RunningProcess[], secrets: string[]): void {
  const logs = processes.flatMap((p) => p.lines).join('\n');
  expect(logs.length).toBeGreaterThan(0);
  for (const s of secrets) expect(logs.includes(s), 'a secret in the logs').toBe(false);
}

// Up to four batch waits per test (50 s each, the client's default) and restarts between them.
describe('faults', { timeout: 300_000 }, () => {
  it('Redis killed and restarted on its AOF mid-batch: the batch completes with every item exactly once', async () => {
    // One node:crypto thread, one chunk at a time: slow enough to be killed part way.
    const { client, api, worker, admin } = await stack({ KEYFLEET_KERNEL: 'js', WORKER_THREADS: '1', WORKER_CONCURRENCY: '1', CHUNK_ITEMS: '5000', JOB_LOCK_MS: '3000' });
    const originals = Array.from({ length: 400_000 }, (_, i) => serial(i));
    const submitted = await client.uploadNdjson('encrypt', 'serials', originals);
    expect(submitted.status).toBe(202);
    const id = submitted.body.batchId;
    let before: any;
    do {
      await sleep(50);
      before = await statusOf(client, id);
    } while (before.processed < 20_000);
    expect(before.processed).toBeLessThan(originals.length);

    await ownRedis.kill();
    await sleep(1_000);
    await ownRedis.start();

    await expectExactlyOnce(client, id, originals);
    expectNoSecrets([api, worker], [admin.token, originals[0]!, originals[123_456]!]);
  });

  it('API killed mid-upload: the client sees an error, and the half-uploaded batch is never completed but fails as abandoned', async () => {
    const { env, client, worker, admin } = await stack({ CHUNK_ITEMS: '1000', UPLOAD_IDLE_SECONDS: '3' });
    const api = running.at(-2)!;
    const redis = new Redis(ownRedis.url);
    try {
      const sent = Array.from({ length: 10_000 }, (_, i) => JSON.stringify(serial(i)) + '\n').join('');
      let stop: () => void = () => {};
      const stalled = new Promise<void>((resolve) => (stop = resolve));
      // 10,000 items, then the body stalls as if the client were slow: the API dies meanwhile.
      const body = new ReadableStream<Uint8Array>({
        async start(controller) {
          controller.enqueue(new TextEncoder().encode(sent));
          await stalled;
          controller.close();
        },
      });
      const upload = fetch(`${client.base}/v1/batches?op=encrypt&key=serials`, {
        method: 'POST',
        headers: { authorization: `Bearer ${admin.token}`, 'content-type': 'application/x-ndjson' },
        body,
        duplex: 'half',
      } as RequestInit).then(
        () => 'answered',
        (err: Error) => err,
      );
      const tenantBatches = `${env['KEYFLEET_PREFIX']}:tenant:acme:batches`;
      let id: string | undefined;
      while (!id || Number(await redis.hget(`${env['KEYFLEET_PREFIX']}:batch:${id}`, 'total')) < 10_000) {
        await sleep(50);
        id = (await redis.smembers(tenantBatches))[0];
      }
      await api.kill();
      expect(await upload).toBeInstanceOf(Error);
      stop();

      // A new API; the worker processes what was stored, and the batch never completes. Nobody
      // reads the batch: the API's sweep fails it once its upload's lease lapses (3 s + 2 × 1 s here).
      const api2 = await startApi(env);
      running.push(api2);
      const client2 = new Client(api2.url, admin.token);
      const seen = new Set<string>();
      for (let i = 0; i < 200; i++) {
        const stored = await redis.hget(`${env['KEYFLEET_PREFIX']}:batch:${id}`, 'status');
        seen.add(stored!);
        if (stored === 'failed') break;
        await sleep(100);
      }
      expect(seen.has('completed')).toBe(false);
      expect(seen.has('failed')).toBe(true);
      const status = await statusOf(client2, id);
      expect(status).toMatchObject({ status: 'failed', error: { code: 'KF_UPLOAD_ABORTED' } });
      // It never had all its items: no results, not the part that ran.
      const results = await client2.json('GET', `/v1/batches/${id}/results`);
      expect(results).toEqual({ status: 409, body: { error: { code: 'KF_BATCH_FAILED', message: `the batch failed during its upload (KF_UPLOAD_ABORTED); it has no results (GET /v1/batches/${id} says why)` } } });
      expect(Number(await redis.get(`${env['KEYFLEET_PREFIX']}:backlog-items`))).toBe(0);
      expectNoSecrets([api, api2, worker], [admin.token, serial(0), serial(9_999)]);
    } finally {
      await redis.quit();
    }
  });

  it('Redis unreachable: the async path answers 503 with Retry-After, then recovers by itself, and the worker reconnects without help', async () => {
    const { client, api, worker, admin } = await stack({});
    expect((await client.uploadNdjson('encrypt', 'serials', ['warm-up'])).status).toBe(202);
    const workerReady = `http://127.0.0.1:${(JSON.parse(await worker.waitFor(/"msg":"worker started"/)) as { metricsPort: number }).metricsPort}/readyz`;
    expect((await fetch(workerReady)).status).toBe(200);

    await ownRedis.kill();
    const down = await fetch(`${client.base}/v1/batches?op=encrypt&key=serials`, {
      method: 'POST',
      headers: { authorization: `Bearer ${admin.token}`, 'content-type': 'application/x-ndjson' },
      body: '"while-down"\n',
    });
    expect(down.status).toBe(503);
    expect(((await down.json()) as any).error.code).toBe('KF_REDIS_UNAVAILABLE');
    expect(Number(down.headers.get('retry-after'))).toBeGreaterThan(0);
    const apiNotReady = await fetch(`${client.base}/readyz`);
    expect(apiNotReady.status).toBe(503);
    // The worker's probe answers too, rather than hanging until Redis is back, and as the API does.
    const workerNotReady = await fetch(workerReady, { signal: AbortSignal.timeout(5_000) });
    expect(workerNotReady.status).toBe(503);
    expect(await workerNotReady.json()).toEqual(await apiNotReady.json());
    expect(workerNotReady.headers.get('retry-after')).toBe(apiNotReady.headers.get('retry-after'));
    await sleep(2_000);
    await ownRedis.start();

    const originals = Array.from({ length: 20_000 }, (_, i) => serial(i));
    let accepted: { status: number; body: any } | undefined;
    for (let i = 0; i < 100 && accepted?.status !== 202; i++) {
      if (i > 0) await sleep(200);
      accepted = await client.uploadNdjson('encrypt', 'serials', originals).catch(() => undefined);
    }
    expect(accepted?.status).toBe(202);
    expect((await fetch(`${client.base}/readyz`)).status).toBe(200);
    let workerStatus = 0;
    for (let i = 0; i < 50 && workerStatus !== 200; i++) {
      if (i > 0) await sleep(200);
      workerStatus = (await fetch(workerReady)).status;
    }
    expect(workerStatus).toBe(200);
    await expectExactlyOnce(client, accepted!.body.batchId, originals);
    expectNoSecrets([api, worker], [admin.token, originals[0]!]);
  });

  it('Redis unreachable: API and worker log each distinct error once as a JSON line, not a stack per reconnect attempt or a line per failed request, and a worker told to stop exits after WORKER_DRAIN_SECONDS', async () => {
    const { api, worker, client } = await stack({ WORKER_DRAIN_SECONDS: '3' });
    await worker.waitFor(/"msg":"worker started"/);
    await ownRedis.kill();
    try {
      // Requests fail alike while it is down: 503 each, their error logged once.
      const failed = await Promise.all(Array.from({ length: 20 }, () => client.json('GET', '/v1/keys/serials')));
      expect(failed.map((r) => r.status)).toEqual(Array(20).fill(503));
      // Long enough for about a dozen reconnect attempts on each connection (0.2 s, 0.4 s, …).
      await sleep(4_000);
      worker.child.kill('SIGTERM');
      // The deadline's 3 s, plus a margin for a loaded machine; without it the worker waited for Redis.
      expect(await Promise.race([worker.exited, sleep(15_000).then(() => 'still running')])).toBe(1);
      expect(worker.lines.some((l) => l.includes('drain not finished within WORKER_DRAIN_SECONDS'))).toBe(true);
    } finally {
      await ownRedis.start();
    }
    await api.waitFor(/"msg":"redis connection ready again"/);
    for (const [name, lines] of [['api', api.lines], ['worker', worker.lines]] as const) {
      const records = lines.map((line) => {
        try {
          return JSON.parse(line) as { level: number; err?: { message: string } };
        } catch {
          throw new Error(`${name} wrote a line that is not JSON: ${line}`);
        }
      });
      const errors = records.filter((r) => r.level >= 40 && r.err).map((r) => r.err!.message);
      expect(errors.length, `${name}: an error logged`).toBeGreaterThan(0);
      // Each message once within the 30 s interval, however many connections, attempts and requests saw it.
      expect(errors, name).toEqual([...new Set(errors)]);
    }
  });

  it('Redis unreachable: an API stopped with an event stream open exits without waiting for Redis', async () => {
    const { api, worker, client, admin } = await stack({});
    expect(await worker.stop()).toBe(0); // no worker: the batch stays queued and its stream open
    const { batchId } = (await client.uploadNdjson('encrypt', 'serials', ['queued'])).body;
    const events = await fetch(`${client.base}/v1/batches/${batchId}/events`, { headers: { authorization: `Bearer ${admin.token}` } });
    expect(events.status).toBe(200);
    const reader = events.body!.getReader();
    expect(new TextDecoder().decode((await reader.read()).value)).toContain('event: progress');
    await ownRedis.kill();
    try {
      await sleep(1_000);
      api.child.kill('SIGTERM');
      // Before, closing the subscriber connection waited behind its queued re-SUBSCRIBE for ever.
      expect(await Promise.race([api.exited, sleep(15_000).then(() => 'still running')])).toBe(0);
    } finally {
      await reader.cancel().catch(() => {});
      await ownRedis.start();
    }
  });

  it('Redis unreachable: event streams that fail end, and their failure is logged once, not once per stream', async () => {
    const { api, worker, client, admin } = await stack({});
    expect(await worker.stop()).toBe(0); // no worker: the batch stays queued and its streams open
    const { batchId } = (await client.uploadNdjson('encrypt', 'serials', ['queued'])).body;
    const readers = await Promise.all(
      Array.from({ length: 10 }, async () => {
        const events = await fetch(`${client.base}/v1/batches/${batchId}/events`, { headers: { authorization: `Bearer ${admin.token}` } });
        const reader = events.body!.getReader();
        expect(new TextDecoder().decode((await reader.read()).value)).toContain('event: progress');
        return reader;
      }),
    );
    await ownRedis.kill();
    try {
      // Each stream's next poll (every 2 s) fails, and the stream ends.
      const ended = await Promise.all(readers.map(async (reader) => {
        for (;;) if ((await reader.read()).done) return true;
      }));
      expect(ended).toEqual(Array(10).fill(true));
      // The API's log lines reach its stdout a moment after the streams end.
      await api.waitFor(/event stream failed/);
      await sleep(1_000);
      // Each distinct message once (the streams fail with one or two: a timed-out command, a
      // command refused after the connection's retries), not a line per stream.
      const failures = api.lines.filter((l) => l.includes('event stream failed')).map((l) => JSON.parse(l) as { source: string; batchId: string; err: { message: string } });
      const messages = failures.map((f) => f.err.message);
      expect(failures.length, messages.join('\n')).toBeGreaterThan(0);
      expect(messages, messages.join('\n')).toEqual([...new Set(messages)]);
      expect(failures.length, messages.join('\n')).toBeLessThanOrEqual(2);
      expect(failures[0]).toMatchObject({ source: 'event-stream', batchId });
    } finally {
      await Promise.all(readers.map((reader) => reader.cancel().catch(() => {})));
      await ownRedis.start();
    }
  });

  it('Redis stalled (connections open, no answers): requests answer 503 within seconds instead of hanging, the sync path still encrypts with a cached key, and all recovers', async () => {
    const { client, admin } = await stack({ KEY_CACHE_TTL_MS: '60000' });
    const encrypt = () =>
      fetch(`${client.base}/v1/encrypt/serials`, {
        method: 'POST',
        headers: { authorization: `Bearer ${admin.token}`, 'content-type': 'application/json' },
        body: JSON.stringify({ items: ['stalled-1'] }),
        signal: AbortSignal.timeout(20_000),
      });
    expect((await encrypt()).status).toBe(200); // the key is now cached
    const { batchId } = (await client.uploadNdjson('encrypt', 'serials', ['stalled-batch'])).body;

    ownRedis.pause();
    try {
      // A batch's event stream is refused, not left open and silent.
      const events = await fetch(`${client.base}/v1/batches/${batchId}/events`, { headers: { authorization: `Bearer ${admin.token}` }, signal: AbortSignal.timeout(20_000) });
      expect(events.status).toBe(503);
      // The rate limiter counts in the API without waiting on Redis; the key is cached.
      expect((await encrypt()).status).toBe(200);
      const keys = await fetch(`${client.base}/v1/keys/serials`, { headers: { authorization: `Bearer ${admin.token}` }, signal: AbortSignal.timeout(20_000) });
      expect(keys.status).toBe(503);
      expect(((await keys.json()) as any).error.code).toBe('KF_REDIS_UNAVAILABLE');
      expect(Number(keys.headers.get('retry-after'))).toBeGreaterThan(0);
    } finally {
      ownRedis.resume();
    }
    let status = 0;
    for (let i = 0; i < 50 && status !== 200; i++) {
      if (i > 0) await sleep(200);
      status = (await client.json('GET', '/v1/keys/serials')).status;
    }
    expect(status).toBe(200);
  });

  it('Redis stalled under a slow results download: the download stops short, the API stays up, and serves it in full once Redis is back', async () => {
    // Chunks of ~4.5 MB of lines: the client pauses in the middle of one, after the next was read ahead.
    const { client, admin, api } = await stack({ CHUNK_ITEMS: '10000' });
    // ~20 MB of result lines: more than loopback's socket buffers take in while the client waits.
    const items = Array.from({ length: 40_000 }, (_, i) => serial(i).padEnd(320, '.'));
    const { batchId } = (await client.uploadNdjson('encrypt', 'serials', items)).body;
    expect((await client.waitForBatch(batchId)).status).toBe('completed');

    const download = await new Promise<http.IncomingMessage>((resolve, reject) =>
      http.get(`${client.base}/v1/batches/${batchId}/results`, { headers: { authorization: `Bearer ${admin.token}` } }, resolve).on('error', reject));
    expect(download.statusCode).toBe(200);
    download.on('error', () => {}); // it breaks off while Redis stalls
    download.pause();
    await sleep(500); // the API fills the socket and waits, the next chunk read ahead
    ownRedis.pause();
    try {
      // About 1 MB/s: a chunk's lines take longer to send than a Redis command may take (2 s),
      // so the chunk after them, read ahead while Redis stalls, fails while nobody waits on it yet.
      for (const until = Date.now() + 12_000; Date.now() < until && !download.readableEnded && !download.destroyed; ) {
        for (let taken = 0, piece: Buffer | null; taken < 100_000 && (piece = download.read()) !== null; ) taken += piece.length;
        await sleep(100);
      }
      expect(download.complete).toBe(false);
      expect(api.child.exitCode).toBeNull();
      expect((await fetch(`${client.base}/healthz`, { signal: AbortSignal.timeout(5_000) })).status).toBe(200);
    } finally {
      ownRedis.resume();
      download.destroy();
    }
    expect((await client.results(batchId)).map((line) => line.i)).toEqual(items.map((_, i) => i));
    expect(api.child.exitCode).toBeNull();
  });

  it('Redis full (maxmemory, noeviction): an upload gets 503 KF_REDIS_FULL with Retry-After, the API stays up, and its log line names the refused command without its data', async () => {
    const { api, worker, client, admin, port } = await stack({});
    await worker.waitFor(/"msg":"worker started"/);
    const redis = new Redis(ownRedis.url);
    try {
      const used = Number(/used_memory:(\d+)/.exec(await redis.info('memory'))![1]);
      await redis.config('SET', 'maxmemory', String(used + 2 * 1024 * 1024));
      // 100,000 items: about 4 MB of sealed chunk inputs, past the 2 MB left.
      const refused = await fetch(`http://127.0.0.1:${port}/v1/batches?op=encrypt&key=serials`, {
        method: 'POST',
        headers: { authorization: `Bearer ${admin.token}`, 'content-type': 'application/x-ndjson' },
        body: Array.from({ length: 100_000 }, (_, i) => JSON.stringify(serial(i))).join('\n'),
      });
      expect(refused.status).toBe(503);
      expect(refused.headers.get('retry-after')).toBe('5');
      expect(((await refused.json()) as { error: unknown }).error).toEqual({ code: 'KF_REDIS_FULL', message: 'the backing store is full; retry later' });
      await redis.config('SET', 'maxmemory', '0');
      expect((await client.json('POST', '/v1/encrypt/serials', { items: ['after'] })).status).toBe(200);
      // One short line for the refused write: as an unhandled error it was 850 KB, the command's
      // arguments (the chunk's sealed bytes) written out by pino's own error serializer.
      const full = api.lines.filter((l) => l.includes('redis full'));
      expect(full).toHaveLength(1);
      expect(full[0]!.length).toBeLessThan(1_024);
      expect(JSON.parse(full[0]!)).toMatchObject({ level: 50, msg: 'request failed: redis full (maxmemory)', code: 'KF_REDIS_FULL', err: { message: expect.stringMatching(/^OOM /), command: expect.stringMatching(/^[a-z]+$/) } });
      expect(api.lines.every((l) => l.length < 4_096)).toBe(true);
      expectNoSecrets([api, worker], [admin.token, serial(150)]);
    } finally {
      await redis.config('SET', 'maxmemory', '0');
      await redis.quit();
    }
  });

  it('Redis that may evict keys (maxmemory-policy allkeys-lru): the API and the worker each log an error naming the policy, at start and at each reconnect', async () => {
    const redis = new Redis(ownRedis.url);
    try {
      await redis.config('SET', 'maxmemory-policy', 'allkeys-lru');
      const { api, worker } = await stack({});
      const evicting = (lines: string[]) => lines.filter((l) => l.includes('redis may evict keys')).map((l) => JSON.parse(l) as Record<string, unknown>);
      await Promise.all([api.waitFor(/redis may evict keys/), worker.waitFor(/redis may evict keys/)]);
      for (const lines of [api.lines, worker.lines]) {
        expect(evicting(lines)).toEqual([expect.objectContaining({ level: 50, maxmemoryPolicy: 'allkeys-lru', msg: expect.stringContaining('keyfleet needs maxmemory-policy noeviction') })]);
      }
      // Put right, and the connections made again: no more such lines.
      await redis.config('SET', 'maxmemory-policy', 'noeviction');
      await redis.call('CLIENT', 'KILL', 'TYPE', 'normal', 'SKIPME', 'yes');
      await sleep(2_000);
      expect([evicting(api.lines).length, evicting(worker.lines).length]).toEqual([1, 1]);
      // Evicting again: the next reconnect says so.
      await redis.config('SET', 'maxmemory-policy', 'volatile-lru');
      await redis.call('CLIENT', 'KILL', 'TYPE', 'normal', 'SKIPME', 'yes');
      for (let i = 0; i < 50 && evicting(api.lines).length < 2; i++) await sleep(100);
      expect(evicting(api.lines).at(-1)).toMatchObject({ maxmemoryPolicy: 'volatile-lru' });
    } finally {
      await redis.config('SET', 'maxmemory-policy', 'noeviction');
      await redis.quit();
    }
  });

  it('a poison chunk (it fails on every attempt) ends its batch failed with the reason; other batches are unaffected', async () => {
    const { env, admin } = testEnv({ CHUNK_ITEMS: '100', JOB_ATTEMPTS: '2' });
    const app: FastifyInstance = await buildApp({ config: configFrom(env) });
    const address = await app.listen({ host: '127.0.0.1', port: 0 });
    const redis = new Redis(env['REDIS_URL']!);
    try {
      const client = new Client(address, admin.token);
      expect((await client.json('POST', '/v1/keys/serials')).status).toBe(201);
      const poisoned = await client.uploadNdjson('encrypt', 'serials', Array.from({ length: 300 }, (_, i) => serial(i)));
      // Chunk 1's stored input no longer opens: every run of it fails.
      await redis.set(`${env['KEYFLEET_PREFIX']}:batch:${poisoned.body.batchId}:in:1`, Buffer.from('not a sealed chunk at all'));
      const healthy = Array.from({ length: 300 }, (_, i) => serial(1_000 + i));
      const fine = await client.uploadNdjson('encrypt', 'serials', healthy);

      const worker = await startWorker(env);
      running.push(worker);
      const failed = await client.waitForBatch(poisoned.body.batchId);
      expect(failed).toMatchObject({ status: 'failed', error: { code: 'KF_CHUNK_FAILED', message: expect.stringMatching(/chunk 1 failed after 2 attempt/) } });
      // Chunk 1's items were never processed; chunks 0 and 2 give their results if they ran
      // before the batch failed, and are never half there.
      const lines = await client.results(poisoned.body.batchId);
      expect(lines.map((line) => line.i)).toEqual(Array.from({ length: 300 }, (_, i) => i));
      const chunks = [0, 1, 2].map((c) => lines.slice(c * 100, c * 100 + 100));
      expect(chunks[1]!.every((line) => line.error?.code === 'KF_ITEM_NOT_PROCESSED')).toBe(true);
      for (const chunk of [chunks[0]!, chunks[2]!]) {
        expect([chunk.every((line) => line.ciphertext?.startsWith('kf:v1:')), chunk.every((line) => line.error?.code === 'KF_ITEM_NOT_PROCESSED')]).toContain(true);
      }
      expect(lines.filter((line) => line.ciphertext).length).toBe(failed.succeeded);
      await expectExactlyOnce(client, fine.body.batchId, healthy);
      expectNoSecrets([worker], [admin.token, serial(150)]);
    } finally {
      await redis.quit();
      await app.close();
    }
  });
});
