import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { buildApp } from '../../producer/app.js';
import { AtRestSealer } from '../../shared/at-rest.js';
import { BatchStore } from '../../shared/batch-store.js';
import { RedisKeys } from '../../shared/redis.js';
import { Client } from '../helpers/client.js';
import { configFrom, testEnv } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';

// RESULT_TTL_SECONDS is at least 60 in the environment, so the workers run with 60; the API runs
// in this process with 2 (set past the parsed config) so that a batch can wait in the queue
// longer than the results TTL of the process that created it without a slow test.
const RESULT_TTL = 60;
const API_RESULT_TTL = 2;
const { env, admin } = testEnv({ CHUNK_ITEMS: '100', SYNC_MAX_ITEMS: '1', RESULT_TTL_SECONDS: String(RESULT_TTL) });
const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
let app: FastifyInstance;
let client: Client;
let redis: Redis;
let worker: RunningProcess | undefined;

beforeAll(async () => {
  redis = new Redis(env['REDIS_URL']!);
  app = await buildApp({ config: { ...configFrom(env), resultTtlSeconds: API_RESULT_TTL } });
  client = new Client(await app.listen({ host: '127.0.0.1', port: 0 }), admin.token);
  expect((await client.json('POST', '/v1/keys/serials')).status).toBe(201);
});

afterEach(async () => {
  await worker?.stop();
  worker = undefined;
});

afterAll(async () => {
  await app?.close();
  await redis?.quit();
});

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const items = (n: number, tag: string) => Array.from({ length: n }, (_, i) => `${tag}-${i}`);
const backlog = async () => Number((await redis.get(keys.backlogItems())) ?? 0);

async function queue(n: number, tag: string): Promise<string> {
  const res = await client.uploadNdjson('encrypt', 'serials', items(n, tag));
  expect(res.status).toBe(202);
  return res.body.batchId;
}

/** Polls until `check` holds, up to `timeoutMs`; its last answer either way. */
async function eventually<T>(read: () => Promise<T>, check: (value: T) => boolean, timeoutMs = 15_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await read();
    if (check(value) || Date.now() > deadline) return value;
    await sleep(100);
  }
}

/** Waits until no chunk job is waiting, delayed or running. */
async function queueDrained(): Promise<void> {
  const counts = await eventually(
    () => app.services.queue.getJobCounts('waiting', 'prioritized', 'delayed', 'active'),
    (c) => Object.values(c).every((n) => n === 0),
  );
  expect(counts).toEqual({ waiting: 0, prioritized: 0, delayed: 0, active: 0 });
}

describe('batch lifetimes', () => {
  it('a batch that waits in the queue longer than RESULT_TTL_SECONDS still completes, and its results then expire after RESULT_TTL_SECONDS', async () => {
    const id = await queue(250, 'late'); // 3 chunks
    await sleep(API_RESULT_TTL * 1000 + 1500);
    const waiting = await client.json('GET', `/v1/batches/${id}`);
    expect(waiting.status).toBe(200);
    expect(waiting.body).toMatchObject({ status: 'queued', total: 250, processed: 0 });
    // While open, the record and the inputs live far longer than the results TTL.
    expect(await redis.ttl(keys.batch(id))).toBeGreaterThan(RESULT_TTL);
    for (const c of [0, 1, 2]) expect(await redis.ttl(keys.batchInput(id, c))).toBeGreaterThan(RESULT_TTL);

    worker = await startWorker(env);
    expect(await client.waitForBatch(id, 20_000)).toMatchObject({ status: 'completed', total: 250, processed: 250, succeeded: 250 });
    const lines = await client.results(id);
    expect(lines.map((l) => l.i)).toEqual(items(250, 'late').map((_, i) => i));
    for (const i of [0, 249]) {
      const opened = await client.json('POST', '/v1/decrypt/serials', { items: [lines[i]!.ciphertext] }); // one item: SYNC_MAX_ITEMS is 1
      expect(opened.body.results).toEqual([{ plaintext: `late-${i}` }]);
    }

    // The results clock started at completion: record, done set, chunk starts and every chunk's results stay RESULT_TTL_SECONDS.
    for (const key of [keys.batch(id), keys.batchDone(id), keys.batchStarts(id), keys.batchResult(id, 0), keys.batchResult(id, 1), keys.batchResult(id, 2)]) {
      const ttl = await redis.ttl(key);
      expect(ttl, key).toBeGreaterThan(0);
      expect(ttl, key).toBeLessThanOrEqual(RESULT_TTL);
    }
    expect(await redis.keys(`${keys.batch(id)}:in:*`)).toEqual([]);
    expect(await backlog()).toBe(0);
  });

  it('the backlog counter returns to zero when a chunk\'s batch is gone, and a cancelled batch\'s chunks are not subtracted twice', async () => {
    const before = await backlog();
    const expired = await queue(250, 'expired'); // 3 chunks
    const cancelled = await queue(150, 'cancelled'); // 2 chunks
    expect(await backlog()).toBe(before + 400);
    expect((await client.json('DELETE', `/v1/batches/${cancelled}`)).body.status).toBe('cancelled');
    expect(await backlog()).toBe(before + 250);
    // Both records disappear while their chunk jobs wait: what Redis does to an open batch that
    // nothing happened to for its open lifetime (the record goes first; its inputs outlive it),
    // and to a cancelled one after RESULT_TTL_SECONDS.
    await redis.del(keys.batch(expired), keys.batch(cancelled));
    expect((await client.json('GET', `/v1/batches/${expired}`)).status).toBe(404);

    worker = await startWorker(env);
    await queueDrained();
    expect(await eventually(backlog, (n) => n === before)).toBe(before);
    expect(await redis.get(keys.backlogItems())).toBe(String(before)); // not below: nothing subtracted twice
    expect(await redis.keys(`${keys.batch(expired)}*`)).toEqual([]);
  });

  it('a batch whose chunk input expired before the chunk ran fails, and its items leave the backlog', async () => {
    const before = await backlog();
    const id = await queue(250, 'lost');
    await redis.del(keys.batchInput(id, 1)); // what its TTL does to an input that waited too long
    worker = await startWorker(env);
    const ended = await eventually(() => client.json('GET', `/v1/batches/${id}`).then((r) => r.body), (b) => b.status !== 'queued' && b.status !== 'running');
    expect(ended).toMatchObject({ status: 'failed', error: { code: 'KF_CHUNK_FAILED' } });
    expect(ended.error.message).toMatch(/input of chunk 1 expired/);
    await queueDrained();
    expect(await backlog()).toBe(before);
    const ttl = await redis.ttl(keys.batch(id));
    expect(ttl).toBeGreaterThan(0);
    expect(ttl).toBeLessThanOrEqual(RESULT_TTL);
  });
});

describe('chunks of a batch that is gone', () => {
  const sealer = new AtRestSealer(randomBytes(32));
  const outcome = (count: number) => ({ count, succeeded: count, failed: 0, results: Buffer.from('r\n') });
  const job = { tenant: 't', op: 'encrypt', key: 'k', encoding: 'utf8', sealedFor: 'tenant' } as const;
  /** A sealed batch of three 10-item chunks whose record lives 2 s without news, under its own prefix (so its backlog counter is the test's alone). */
  const sealedBatchOfThreeChunks = async () => {
    const own = new RedisKeys(`{kft-expiry-${randomBytes(4).toString('hex')}}`);
    const store = new BatchStore(redis, own, { resultTtlSeconds: 60, openBatchTtlSeconds: 2, uploadIdleSeconds: 60, sealer });
    const id = await store.create({ ...job, chunkItems: 10 }, 1000);
    for (const c of [0, 1, 2]) await store.addChunk(id, c, Buffer.from(`input-${c}`), 10);
    await store.seal(id);
    return { own, store, id };
  };

  it('a chunk whose batch record expired takes its items out of the backlog once, however often its job runs', async () => {
    const { own, store, id } = await sealedBatchOfThreeChunks();
    expect(await store.backlogItems()).toBe(30);
    expect(Buffer.isBuffer(await store.startChunk(id, 0, 10, job))).toBe(true);

    await sleep(2_500); // the record expired (nothing happened for openBatchTtlSeconds); the inputs live twice as long
    expect(await store.get(id)).toBeUndefined();
    expect(await store.startChunk(id, 0, 10, job)).toBe('batch-gone');
    expect(await store.startChunk(id, 0, 10, job)).toBe('batch-gone'); // a retry of the same job
    expect(await store.backlogItems()).toBe(20);
    // A chunk already running when its batch went: its completion subtracts instead, once too.
    expect(await store.completeChunk(id, 't', 1, outcome(10))).toBe('batch-gone');
    expect(await store.completeChunk(id, 't', 1, outcome(10))).toBe('batch-gone');
    expect(await store.startChunk(id, 1, 10, job)).toBe('batch-gone');
    expect(await store.backlogItems()).toBe(10);
    expect(await store.startChunk(id, 2, 10, job)).toBe('batch-gone');
    expect(await redis.get(own.backlogItems())).toBe('0');
    expect(await redis.keys(`${own.batch(id)}*`)).toEqual([]);
  });

  it('an open batch renews its lifetime as its chunks complete, and a completed chunk is never subtracted again', async () => {
    const { own, store, id } = await sealedBatchOfThreeChunks();
    for (const c of [0, 1]) {
      await sleep(1_200);
      expect(await store.completeChunk(id, 't', c, outcome(10))).toBe('progress');
    }
    // 2.4 s after its creation the batch is still there: each chunk renewed it.
    expect((await store.get(id))!.status).toBe('running');
    expect(await store.completeChunk(id, 't', 2, outcome(10))).toBe('completed');
    expect(await redis.ttl(own.batch(id))).toBeGreaterThan(2);
    expect(await store.backlogItems()).toBe(0);
    // Its record expires later; a rerun of a chunk then finds no input and subtracts nothing.
    await redis.del(own.batch(id));
    expect(await store.startChunk(id, 0, 10, job)).toBe('batch-gone');
    expect(await store.completeChunk(id, 't', 0, outcome(10))).toBe('batch-gone');
    expect(await redis.get(own.backlogItems())).toBe('0');
  });
});

describe('the longest RESULT_TTL_SECONDS', () => {
  const sealer = new AtRestSealer(randomBytes(32));
  const outcome = (count: number) => ({ count, succeeded: count, failed: 0, results: Buffer.from('r\n') });
  const spec = { tenant: 't', op: 'encrypt', key: 'k', encoding: 'utf8', chunkItems: 10 } as const;
  const own = new RedisKeys(`{kft-longest-${randomBytes(4).toString('hex')}}`);
  afterAll(async () => {
    const left = await redis.keys(`${own.prefix}*`);
    if (left.length > 0) await redis.del(...left);
  });

  it('stores, runs and keeps a batch under the longest one accepted; past it, Redis refuses the lifetime of every chunk’s input', async () => {
    const longest = configFrom({ ...env, RESULT_TTL_SECONDS: String(2 ** 52) }).resultTtlSeconds;
    const store = new BatchStore(redis, own, { resultTtlSeconds: longest, uploadIdleSeconds: 60, sealer });
    const id = await store.create(spec, 1000);
    for (const c of [0, 1]) await store.addChunk(id, c, Buffer.from(`input-${c}`), 10);
    expect(await redis.ttl(own.batchInput(id, 0))).toBeGreaterThan(2 * longest - 60); // inputs live twice as long
    expect(await store.seal(id)).toBe('progress');
    expect(await store.completeChunk(id, 't', 0, outcome(10))).toBe('progress');
    expect(await store.completeChunk(id, 't', 1, outcome(10))).toBe('completed');
    for (const key of [own.batch(id), own.batchDone(id), own.batchResult(id, 0), own.batchResult(id, 1)]) {
      expect(await redis.ttl(key)).toBeGreaterThan(longest - 60);
    }
    expect((await store.readResults(id, 't', 1)).take()?.length).toBeGreaterThan(0);

    // The inputs' lifetime, twice the largest safe integer of seconds, passes what a Redis
    // expiry holds (its end in ms since 1970 within 2^63−1): every upload would fail.
    const beyond = new BatchStore(redis, own, { resultTtlSeconds: Number.MAX_SAFE_INTEGER, uploadIdleSeconds: 60, sealer });
    const refused = await beyond.create(spec, 1000);
    await expect(beyond.addChunk(refused, 0, Buffer.from('input-0'), 10)).rejects.toThrow(/invalid expire time/);
  });
});
