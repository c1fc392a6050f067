import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { buildApp } from '../../producer/app.js';
import { RedisKeys } from '../../shared/redis.js';
import { Client } from '../helpers/client.js';
import { configFrom, testEnv } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';
import { seededRandom } from '../helpers/seeded.js';

// Chunks close at 1,000 items or 64 KiB, whichever comes first.
const CHUNK_BYTES = 64 * 1024;
const { env, admin } = testEnv({ CHUNK_ITEMS: '1000', CHUNK_BYTES: String(CHUNK_BYTES) });
const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
const redis = new Redis(env['REDIS_URL']!);
let app: FastifyInstance;
let worker: RunningProcess | undefined;
let client: Client;

beforeAll(async () => {
  app = await buildApp({ config: configFrom(env) });
  client = new Client(await app.listen({ host: '127.0.0.1', port: 0 }), admin.token);
  expect((await client.json('POST', '/v1/keys/serials')).status).toBe(201);
  worker = await startWorker(env);
});

afterAll(async () => {
  await worker?.stop();
  await app?.close();
  await redis.quit();
});

describe('chunks of large items (CHUNK_BYTES)', () => {
  it('closes a chunk at CHUNK_BYTES, and the results still come back in order, from any item', async () => {
    // 4,000 items of up to 6 KB, every 50th with non-ASCII text (the JavaScript parser, not the
    // native packer), one of the largest size allowed, and a run of 1,500 short ones that fill a
    // chunk by count first.
    const rand = seededRandom(4242);
    const originals = Array.from({ length: 4_000 }, (_, i) => {
      if (i === 1_234) return 'M'.repeat(64 * 1024);
      if (i >= 1_500 && i < 3_000) return `short-${i}`;
      const body = `item-${i}-` + 'x'.repeat(Math.floor(rand() * 6_000));
      return i % 50 === 0 ? `${body}-ü✓` : body;
    });
    const submitted = await client.uploadNdjson('encrypt', 'serials', originals);
    expect(submitted.status).toBe(202);
    const batchId = submitted.body.batchId as string;
    expect(await client.waitForBatch(batchId)).toMatchObject({ status: 'completed', total: 4_000, succeeded: 4_000 });

    // Far more chunks than 4,000 items at 1,000 each; every chunk within the cap by one item at most.
    const chunks = Number(await redis.hget(keys.batch(batchId), 'chunks'));
    expect(chunks).toBeGreaterThan(50);
    const starts = (await redis.getBuffer(keys.batchStarts(batchId)))!;
    expect(starts.length).toBe(chunks * 4);
    const firsts = Array.from({ length: chunks }, (_, c) => starts.readUInt32BE(c * 4));
    expect(firsts[0]).toBe(0);
    for (let c = 0; c < chunks; c++) {
      const end = c + 1 < chunks ? firsts[c + 1]! : originals.length;
      const items = originals.slice(firsts[c], end);
      expect(items.length).toBeGreaterThan(0);
      expect(items.length).toBeLessThanOrEqual(1_000);
      const bytes = items.reduce((sum, item) => sum + 5 + Buffer.byteLength(item), 0);
      const last = 5 + Buffer.byteLength(items.at(-1)!);
      if (c + 1 < chunks) expect(bytes >= CHUNK_BYTES || items.length === 1_000).toBe(true);
      expect(bytes - last).toBeLessThan(CHUNK_BYTES);
    }
    expect(firsts.some((first, c) => c > 0 && first - firsts[c - 1]! === 1_000)).toBe(true); // the short run closed one by count

    const sealed = await client.results(batchId);
    expect(sealed.map((l) => l.i)).toEqual(originals.map((_, i) => i));
    // A download resumed inside a chunk, on a chunk's first item, on the large item, at the last.
    for (const from of [firsts[7]! + 3, firsts[40]!, 1_234, 3_999]) {
      const rest = await client.results(batchId, from);
      expect(rest.map((l) => l.i)).toEqual(sealed.slice(from).map((l) => l.i));
      expect(rest.map((l) => l.ciphertext)).toEqual(sealed.slice(from).map((l) => l.ciphertext));
    }

    const back = await client.uploadNdjson('decrypt', 'serials', sealed.map((l) => l.ciphertext!));
    expect(await client.waitForBatch(back.body.batchId)).toMatchObject({ status: 'completed', succeeded: 4_000 });
    const opened = await client.results(back.body.batchId);
    expect(opened.map((l) => l.plaintext)).toEqual(originals);
  });

  it('answers 410 for results whose chunk starts are gone, rather than number them wrongly', async () => {
    const submitted = await client.uploadNdjson('encrypt', 'serials', ['a', 'b', 'c']);
    const batchId = submitted.body.batchId as string;
    await client.waitForBatch(batchId);
    expect((await client.results(batchId)).map((l) => l.i)).toEqual([0, 1, 2]);
    await redis.del(keys.batchStarts(batchId)); // as an eviction would
    const res = await client.json('GET', `/v1/batches/${batchId}/results`);
    expect(res).toMatchObject({ status: 410, body: { error: { code: 'KF_BATCH_DELETED' } } });
  });

  it('deletes the chunk starts with the batch', async () => {
    const submitted = await client.uploadNdjson('encrypt', 'serials', ['a', 'b', 'c']);
    const batchId = submitted.body.batchId as string;
    await client.waitForBatch(batchId);
    expect(await redis.exists(keys.batchStarts(batchId))).toBe(1);
    expect(await redis.ttl(keys.batchStarts(batchId))).toBeGreaterThan(0);
    expect((await client.json('DELETE', `/v1/batches/${batchId}`)).status).toBe(200);
    expect(await redis.exists(keys.batchStarts(batchId))).toBe(0);
  });
});
