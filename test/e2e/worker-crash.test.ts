import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Client } from '../helpers/client.js';
import { testEnv } from '../helpers/env.js';
import { runEntry, startApi, startWorker, type RunningProcess } from '../helpers/processes.js';

// One thread, one chunk at a time, small chunks: the batch is long enough to be caught mid-way.
// A short lock lets the replacement worker reclaim the dead worker's chunk within seconds.
const { env, admin } = testEnv({ CHUNK_ITEMS: '2000', WORKER_THREADS: '1', WORKER_CONCURRENCY: '1', JOB_LOCK_MS: '2000' });
const processes: RunningProcess[] = [];
let client: Client;

beforeAll(async () => {
  const api = await startApi(env);
  processes.push(api);
  client = new Client(api.url, admin.token);
  expect((await client.json('POST', '/v1/keys/fleet')).status).toBe(201);
});

afterAll(async () => {
  await Promise.all(processes.map((p) => p.stop()));
});

async function waitUntil(check: () => Promise<boolean>, timeoutMs: number): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > deadline) throw new Error(`condition not met within ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 10));
  }
}

// Up to four batch waits per test (50 s each, the client's default) and restarts between them.
describe('worker fleet', { timeout: 300_000 }, () => {
  it('a worker killed with SIGKILL mid-batch is replaced and the batch completes with exactly one result per item', async () => {
    const originals = Array.from({ length: 300_000 }, (_, i) => `crash-${i}-${(i * 31) % 977}`);
    // The first worker runs the node:crypto kernel, its replacement the native one: the batch's
    // results come from both, and the native kernel decrypts them all below.
    const first = await startWorker({ ...env, KEYFLEET_KERNEL: 'js' });
    processes.push(first);
    const submitted = await client.uploadNdjson('encrypt', 'fleet', originals);
    expect(submitted.status).toBe(202);
    const id = submitted.body.batchId;

    let seenAtKill = 0;
    await waitUntil(async () => {
      seenAtKill = (await client.json('GET', `/v1/batches/${id}`)).body.processed;
      return seenAtKill > 0;
    }, 60_000);
    await first.kill();
    expect(seenAtKill).toBeLessThan(300_000);
    // The chunk it held, if it held one (it may have died between two): BullMQ's list of active jobs.
    const redis = new Redis(env['REDIS_URL']!);
    const held = await redis.llen(`${env['KEYFLEET_PREFIX']}:chunks:active`).finally(() => redis.quit());
    expect(held).toBeLessThanOrEqual(1);

    const replacement = await startWorker(env);
    processes.push(replacement);
    const done = await client.waitForBatch(id);
    expect(done).toMatchObject({ status: 'completed', total: 300_000, processed: 300_000, succeeded: 300_000, failed: 0 });
    // The dead worker's chunk, retaken once its lock lapsed, is logged by the worker that took it
    // back: maybe after the batch completed, when the chunk's results were stored before the kill
    // (it then runs again as a duplicate).
    if (held > 0) await replacement.waitFor(/"msg":"chunk retaken/, 15_000);
    const retaken = replacement.lines.filter((l) => l.includes('"msg":"chunk retaken')).map((l) => JSON.parse(l) as { level: number; batchId?: string });
    expect(retaken, replacement.lines.join('\n')).toEqual(Array(held).fill(expect.objectContaining({ level: 40, batchId: id })));

    const lines = await client.results(id);
    expect(lines).toHaveLength(300_000);
    lines.forEach((l, n) => expect(l.i).toBe(n));
    expect(new Set(lines.map((l) => l.ciphertext)).size).toBe(300_000);

    const back = await client.uploadNdjson('decrypt', 'fleet', lines.map((l) => l.ciphertext!));
    expect((await client.waitForBatch(back.body.batchId)).succeeded).toBe(300_000);
    const opened = await client.results(back.body.batchId);
    expect(opened.map((l) => l.plaintext)).toEqual(originals);
  });

  it('SIGTERM drains: the worker finishes the chunk in hand, exits 0, and another finishes the batch', async () => {
    const worker = await startWorker(env);
    processes.push(worker);
    const submitted = await client.uploadNdjson('encrypt', 'fleet', Array.from({ length: 100_000 }, (_, i) => `drain-${i}`));
    const id = submitted.body.batchId;
    await waitUntil(async () => (await client.json('GET', `/v1/batches/${id}`)).body.processed > 0, 60_000);
    expect(await worker.stop()).toBe(0);
    expect(worker.lines.some((l) => l.includes('"msg":"worker stopped"'))).toBe(true);

    processes.push(await startWorker(env));
    expect(await client.waitForBatch(id)).toMatchObject({ status: 'completed', processed: 100_000, succeeded: 100_000 });
    const lines = await client.results(id);
    expect(lines.map((l) => l.i)).toEqual(Array.from({ length: 100_000 }, (_, i) => i));
  });

  it('a second worker on a host whose metrics port the first holds exits 1 with one fatal line naming WORKER_METRICS_PORT, and the first keeps serving', async () => {
    const first = await startWorker(env);
    processes.push(first);
    const port = (JSON.parse(await first.waitFor(/"msg":"worker started"/)) as { metricsPort: number }).metricsPort;
    const second = runEntry('worker/main.js', { ...env, LOG_LEVEL: 'info', WORKER_METRICS_PORT: String(port) });
    processes.push(second);
    expect(await second.exited).toBe(1);
    // One fatal JSON line says why, as every other line of a worker is JSON; no stack on stderr.
    expect(second.stderr).toEqual([]);
    const fatal = second.stdout.map((l) => JSON.parse(l) as { level: number; msg: string; err?: { message: string } }).filter((l) => l.level === 60);
    expect(fatal).toMatchObject([{ msg: 'could not start', err: { message: `WORKER_METRICS_PORT: port ${port} on 127.0.0.1 is in use: each worker process on one host needs its own WORKER_METRICS_PORT, or 0 for a free one` } }]);
    expect(second.lines.some((l) => l.includes('"msg":"worker started"'))).toBe(false);
    expect((await fetch(`http://127.0.0.1:${port}/healthz`)).status).toBe(200);
  });
});
