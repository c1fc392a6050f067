import type { Job, Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { Registry } from 'prom-client';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { randomBytes } from 'node:crypto';
import type { Socket } from 'node:net';
import { AtRestSealer } from '../../shared/at-rest.js';
import { BatchStore } from '../../shared/batch-store.js';
import { RedisKeys } from '../../shared/redis.js';
import { createLogger } from '../../shared/logger.js';
import { WorkerMetrics } from '../../shared/metrics.js';
import type { ChunkJobData } from '../../shared/schemas.js';
import type { WebhookJobData } from '../../shared/queue.js';
import { createChunkProcessor } from '../../worker/processor.js';
import { WebhookSender } from '../../shared/webhooks.js';
import { testEnv } from '../helpers/env.js';
import { tcpProxy } from '../helpers/net.js';

const { env } = testEnv();
let redis: Redis;
let subscriber: Redis;
let store: BatchStore;
const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
const sealer = new AtRestSealer(randomBytes(32));

beforeAll(() => {
  redis = new Redis(env['REDIS_URL']!);
  subscriber = new Redis(env['REDIS_URL']!);
  store = new BatchStore(redis, keys, { resultTtlSeconds: 600, uploadIdleSeconds: 60, sealer });
});
afterAll(async () => {
  await Promise.all([redis.quit(), subscriber.quit()]);
});

const outcome = (count: number, lines: string) => ({ count, succeeded: count, failed: 0, results: Buffer.from(lines) });

/** What the jobs of `batchWithChunks`'s batches say of them. */
const job = { tenant: 't', op: 'encrypt', key: 'k', encoding: 'utf8', sealedFor: 'tenant' } as const;

async function batchWithChunks(n: number): Promise<string> {
  const id = await store.create({ ...job, chunkItems: 10 }, 1000);
  for (let c = 0; c < n; c++) await store.addChunk(id, c, Buffer.from(`input-${c}`), 10);
  return id;
}

describe('chunk accounting', () => {
  it('gives batches ids that a command line does not read as an option (none starts with - or _)', async () => {
    // One id in 32 would, from 96 random bits in base64url: 300 ids miss both only 0.01% of the time.
    const ids = await Promise.all(Array.from({ length: 300 }, () => store.create({ tenant: 'ids', op: 'encrypt', key: 'k', encoding: 'utf8', chunkItems: 10 }, 1_000)));
    expect(new Set(ids).size).toBe(300);
    for (const id of ids) expect(id).toMatch(/^[A-Za-z0-9][A-Za-z0-9_-]{15}$/);
    await Promise.all(ids.map((id) => store.cancel(id)));
  });

  it('tells which chunks ran from the done bitmap, past its first byte too, and keeps it when the batch fails', async () => {
    const id = await batchWithChunks(20);
    const done = [0, 7, 8, 15, 19];
    for (const c of done) await store.completeChunk(id, 't', c, outcome(10, `chunk ${c}\n`));
    await store.fail(id, 'KF_CHUNK_FAILED');
    const ran = await store.chunksRan(id);
    expect(Array.from({ length: 24 }, (_, c) => c).filter(ran)).toEqual(done);
    expect((await store.get(id))!).toMatchObject({ status: 'failed', processed: 50 });
    // A bitmap that is gone reads as no chunk run.
    expect(Array.from({ length: 20 }, (_, c) => c).filter(await store.chunksRan('no-such-batch'))).toEqual([]);
  });

  it('a chunk completed twice (a retry after a crash) counts once and keeps the first results', async () => {
    const id = await batchWithChunks(2);
    expect(await store.seal(id)).toBe('progress');
    expect(await store.completeChunk(id, 't', 0, outcome(10, 'first\n'))).toBe('progress');
    expect(await store.completeChunk(id, 't', 0, outcome(10, 'second\n'))).toBe('duplicate');
    expect((await store.get(id))!).toMatchObject({ status: 'running', processed: 10, succeeded: 10 });
    expect((await store.readResults(id, 't', 0)).take()!.toString()).toBe('first\n');
    expect(await store.readInput(id, 't', 0)).toBeNull();
    // The second run's staged lines were dropped, not left behind.
    expect((await redis.keys(`${keys.batch(id)}:out:*`)).sort()).toEqual([keys.batchResult(id, 0)]);
  });

  it('the batch completes exactly once and publishes one completion event', async () => {
    const id = await batchWithChunks(3);
    const events: string[] = [];
    await subscriber.subscribe(keys.batchEvents(id));
    subscriber.on('message', (_channel, message) => events.push(message));
    await store.completeChunk(id, 't', 1, outcome(10, 'b\n'));
    await store.completeChunk(id, 't', 0, outcome(10, 'a\n'));
    // Every chunk is done before the upload is sealed: sealing completes it.
    await store.completeChunk(id, 't', 2, outcome(10, 'c\n'));
    expect((await store.get(id))!.status).toBe('running');
    // The caller announces it (webhook, metric): no worker saw the batch complete.
    expect(await store.seal(id)).toBe('completed');
    expect(await store.completeChunk(id, 't', 2, outcome(10, 'c again\n'))).toBe('duplicate');
    const record = (await store.get(id))!;
    expect(record).toMatchObject({ status: 'completed', total: 30, processed: 30 });
    // Redis delivers a channel's messages in the order they were published: once a marker sent
    // after every call above has arrived, so has anything those calls published.
    await redis.publish(keys.batchEvents(id), 'marker');
    for (let i = 0; i < 100 && !events.includes('marker'); i++) await new Promise((r) => setTimeout(r, 20));
    expect(events.at(-1)).toBe('marker');
    expect(events.filter((e) => e === 'completed')).toHaveLength(1);
    await subscriber.unsubscribe();
  });

  it('fails a batch for its upload\'s error only while unsealed: a seal whose reply was lost leaves a batch that runs', async () => {
    const cut = await batchWithChunks(2);
    expect(await store.failUpload(cut, 'KF_UPLOAD_ABORTED')).toBe(true);
    expect((await store.get(cut))!).toMatchObject({ status: 'failed', error: { code: 'KF_UPLOAD_ABORTED' } });
    const sealed = await batchWithChunks(2);
    expect(await store.seal(sealed)).toBe('progress');
    expect(await store.failUpload(sealed, 'KF_UPLOAD_ABORTED')).toBe(false);
    expect(await store.completeChunk(sealed, 't', 0, outcome(10, 'a\n'))).toBe('progress');
    expect(await store.completeChunk(sealed, 't', 1, outcome(10, 'b\n'))).toBe('completed');
    // A worker's failure still ends a sealed batch.
    const failing = await batchWithChunks(1);
    await store.seal(failing);
    expect(await store.fail(failing, 'KF_CHUNK_FAILED')).toBe(true);
  });

  it('a batch that is never sealed (upload cut short) never completes', async () => {
    const id = await batchWithChunks(1);
    await store.completeChunk(id, 't', 0, outcome(10, 'a\n'));
    expect((await store.get(id))!.status).toBe('running');
    await store.fail(id, 'KF_UPLOAD_ABORTED');
    expect((await store.get(id))!).toMatchObject({ status: 'failed', error: { code: 'KF_UPLOAD_ABORTED' } });
    await expect(store.seal(id)).rejects.toMatchObject({ code: 'KF_UPLOAD_ABORTED' });
    expect((await store.get(id))!.status).toBe('failed');
  });

  it('a cancelled batch ignores chunks that finish afterwards and keeps no inputs or results', async () => {
    const id = await batchWithChunks(2);
    await store.seal(id);
    await store.completeChunk(id, 't', 0, outcome(10, 'a\n'));
    await store.cancel(id);
    expect(await store.completeChunk(id, 't', 1, outcome(10, 'b\n'))).toBe('batch-ended');
    expect((await store.get(id))!).toMatchObject({ status: 'cancelled', processed: 10, deleted: true });
    // Nothing of the batch is left but its status record: no input, result or staged run.
    expect(await redis.keys(`${keys.batch(id)}:*`)).toEqual([]);
  });

  it('a completion whose results were not stored (their write refused or lost) marks nothing, and the chunk counts when it runs again', async () => {
    const id = await batchWithChunks(1);
    await store.seal(id);
    // The script as completeChunk sends it, after a SET of the staged results that did not take.
    const missing = keys.batchStaged(id, 0, 'lost');
    const completion = await redis.kfChunkComplete(keys.batch(id), keys.batchInput(id, 0), keys.batchResult(id, 0), keys.batchDone(id), keys.backlogItems(), missing,
      0, 10, 10, 0, 600, new Date().toISOString(), keys.batchEvents(id), 3600, 3600, keys.batch(id));
    expect(completion).toBe(-3);
    expect(await redis.getbit(keys.batchDone(id), 0)).toBe(0);
    // The job runs again: its input is still there, and this time the chunk counts.
    expect(Buffer.isBuffer(await store.startChunk(id, 0, 10, job))).toBe(true);
    expect(await store.completeChunk(id, 't', 0, outcome(10, 'again\n'))).toBe('completed');
    expect((await store.get(id))!).toMatchObject({ status: 'completed', processed: 10 });
    expect((await store.readResults(id, 't', 0)).take()!.toString()).toBe('again\n');
  });

  it('opens no input for a job whose tenant, op, key, encoding, context, target key or sealing is not its batch’s (an edited job), and still opens it for the job as made', async () => {
    const id = await batchWithChunks(1);
    await store.seal(id);
    const edits = [{ tenant: 'other' }, { op: 'decrypt' }, { key: 'other' }, { encoding: 'base64' }, { sealedContext: 'c2VhbGVk' }, { context: 'chosen' }, { targetKey: 'other' }, { sealedFor: undefined }] as const;
    for (const edited of edits) expect(await store.startChunk(id, 0, 10, { ...job, ...edited })).toBe('job-mismatch');
    const input = await store.startChunk(id, 0, 10, job);
    expect(Buffer.isBuffer(input) && input.toString()).toBe('input-0');
    expect((await store.get(id))!).toMatchObject({ status: 'queued', processed: 0 });

    // A rewrap batch with a context and a target key: its jobs carry the context sealed.
    const rewrap = { ...job, op: 'rewrap', targetKey: 'k2' } as const;
    const withBoth = await store.create({ ...rewrap, context: 'customers', chunkItems: 10 }, 1000);
    await store.addChunk(withBoth, 0, Buffer.from('input-0'), 10);
    const made = { ...rewrap, sealedContext: store.sealContext(withBoth, 't', 'customers'), context: '' };
    for (const edited of [{ sealedContext: undefined }, { sealedContext: undefined, context: 'chosen' }, { context: 'chosen' }, { targetKey: undefined }, { targetKey: 'k3' }]) {
      expect(await store.startChunk(withBoth, 0, 10, { ...made, ...edited })).toBe('job-mismatch');
    }
    expect(Buffer.isBuffer(await store.startChunk(withBoth, 0, 10, made))).toBe(true);

    // An earlier API's record says nothing of context, target key or whose its data is sealed
    // for (the batch's alone), and its jobs carry the context in the clear.
    const { sealedFor: _, ...earlier } = rewrap;
    const older = await store.create({ ...earlier, context: 'customers', chunkItems: 10 }, 1000);
    await redis.hdel(keys.batch(older), 'ctx', 'targetKey', 'bound');
    await store.addChunk(older, 0, Buffer.from('input-0'), 10);
    expect(await store.startChunk(older, 0, 10, { ...earlier, context: 'customers' })).toEqual(Buffer.from('input-0'));
    expect(await store.startChunk(older, 0, 10, { ...earlier, tenant: 'other', context: 'customers' })).toBe('job-mismatch');
    expect(await store.startChunk(older, 0, 10, { ...rewrap, context: 'customers' })).toBe('job-mismatch');
  });

  it('a run that finishes after its batch completed and was deleted counts nothing and brings no results back', async () => {
    const id = await batchWithChunks(2);
    await store.seal(id);
    const backlog = Number(await redis.get(keys.backlogItems()));
    // Two runs of chunk 1 hold its input: the job was taken again after its lock was lost.
    expect(Buffer.isBuffer(await store.startChunk(id, 1, 10, job))).toBe(true);
    expect(Buffer.isBuffer(await store.startChunk(id, 1, 10, job))).toBe(true);
    await store.completeChunk(id, 't', 0, outcome(10, 'a\n'));
    expect(await store.completeChunk(id, 't', 1, outcome(10, 'b\n'))).toBe('completed');
    expect(await store.cancel(id)).toBe(false); // DELETE of a completed batch: its results go
    expect(await store.completeChunk(id, 't', 1, outcome(10, 'late\n'))).toBe('duplicate');
    expect((await store.get(id))!).toMatchObject({ status: 'completed', deleted: true, total: 20, processed: 20 });
    expect(Number(await redis.get(keys.backlogItems()))).toBe(backlog - 20);
    expect(await redis.keys(`${keys.batch(id)}:*`)).toEqual([]);
  });

  it('chunks stored out of order (writes in flight together) are all deleted when the batch is cancelled or fails', async () => {
    for (const end of ['cancel', 'fail'] as const) {
      const id = await store.create({ tenant: 't', op: 'encrypt', key: 'k', encoding: 'utf8', chunkItems: 10 }, 1000);
      await store.addChunk(id, 2, Buffer.from('input-2'), 10);
      await store.addChunk(id, 0, Buffer.from('input-0'), 10);
      expect((await store.get(id))!.chunks).toBe(2);
      if (end === 'cancel') await store.cancel(id);
      else await store.fail(id, 'KF_UPLOAD_ABORTED');
      expect(await redis.keys(`${keys.batch(id)}:in:*`)).toEqual([]);
    }
  });
});

/**
 * Between ioredis and Redis: passes everything, except that the first reply to a write holding
 * `marker` never arrives and the connection breaks, as in a network fault after Redis ran the
 * command. ioredis then sends the unanswered commands again on a new connection.
 */
async function replyLosingProxy(marker: string): Promise<{ url: string; lost: () => boolean; close: () => Promise<void> }> {
  const { hostname, port } = new URL(env['REDIS_URL']!);
  let armed = true;
  let lost = false;
  const losing = new WeakSet<Socket>();
  const proxy = await tcpProxy(hostname, Number(port), {
    fromClient(data, { client, upstream }) {
      if (armed && data.includes(marker)) {
        armed = false;
        losing.add(client); // the reply to this command, and the connection with it, are lost
      }
      upstream.write(data);
    },
    fromUpstream(data, connection) {
      if (!losing.has(connection.client)) return void connection.client.write(data);
      lost = true;
      connection.cut();
    },
  });
  return { url: `redis://127.0.0.1:${proxy.port}`, lost: () => lost, close: proxy.close };
}

describe('a reply lost on the way back (ioredis sends the command again)', () => {
  async function storeBehind(marker: string): Promise<{ lossy: BatchStore; done: () => Promise<void> }> {
    const proxy = await replyLosingProxy(marker);
    const client = new Redis(proxy.url);
    client.on('error', () => {}); // the broken connection; ioredis reconnects
    const lossy = new BatchStore(client, keys, { resultTtlSeconds: 600, uploadIdleSeconds: 60, sealer });
    // A proxy that lost nothing would leave these tests proving nothing.
    return { lossy, done: async () => void (await client.quit(), await proxy.close(), expect(proxy.lost()).toBe(true)) };
  }

  it('creating a batch counts once against its tenant\'s limit', async () => {
    // The script's arguments name the record's fields; the membership read before it does not.
    const { lossy, done } = await storeBehind('chunkItems');
    try {
      const id = await lossy.create({ tenant: 'tenant-lost-reply', op: 'encrypt', key: 'k', encoding: 'utf8', chunkItems: 10 }, 1);
      expect((await store.get(id))!.status).toBe('queued');
      expect(await redis.smembers(keys.tenantBatches('tenant-lost-reply'))).toEqual([id]);
    } finally {
      await done();
    }
  });

  it('adding a chunk counts its items once, and the batch completes', async () => {
    const id = await store.create({ tenant: 't', op: 'encrypt', key: 'k', encoding: 'utf8', chunkItems: 10 }, 1000);
    const backlog = await store.backlogItems();
    const { lossy, done } = await storeBehind(keys.batchInput(id, 0));
    try {
      await lossy.addChunk(id, 0, Buffer.from('input-0'), 10);
    } finally {
      await done();
    }
    expect((await store.get(id))!).toMatchObject({ chunks: 1, total: 10 });
    expect((await store.backlogItems()) - backlog).toBe(10);
    expect(await store.seal(id)).toBe('progress');
    expect(await store.completeChunk(id, 't', 0, outcome(10, 'a\n'))).toBe('completed');
    expect((await store.backlogItems()) - backlog).toBe(0);
  });
});

describe('an upload in progress', () => {
  it('holds its lease through the longest wait between renewals: a pause of UPLOAD_IDLE_SECONDS after a piece that did not renew', async () => {
    // Pieces renew the lease at most every keepAliveMs, and may come UPLOAD_IDLE_SECONDS apart.
    const longestWait = 60 * 1000 + store.keepAliveMs;
    const id = await store.create({ tenant: 'lease', op: 'encrypt', key: 'k', encoding: 'utf8', chunkItems: 10 }, 1000);
    expect(await redis.pttl(keys.batchUpload(id))).toBeGreaterThan(longestWait);
    await store.addChunk(id, 0, Buffer.from('input-0'), 10);
    expect(await redis.pttl(keys.batchUpload(id))).toBeGreaterThan(longestWait);
    await store.touchUpload(id);
    expect(await redis.pttl(keys.batchUpload(id))).toBeGreaterThan(longestWait);
    expect(await store.failIfAbandoned(id)).toBe(false);
    await store.cancel(id);
  });
});

describe('backlog', () => {
  it('counts items stored and not yet processed, and returns to zero when batches complete, fail or are cancelled', async () => {
    const own = new BatchStore(redis, new RedisKeys(`{kft-backlog-${Date.now()}}`), { resultTtlSeconds: 600, uploadIdleSeconds: 60, sealer });
    const make = async (chunks: number) => {
      const id = await own.create({ tenant: 't', op: 'encrypt', key: 'k', encoding: 'utf8', chunkItems: 10 }, 1000);
      for (let c = 0; c < chunks; c++) await own.addChunk(id, c, Buffer.from('x'), 10);
      return id;
    };
    const done = await make(2);
    const failed = await make(3);
    const cancelled = await make(1);
    expect(await own.backlogItems()).toBe(60);
    await own.completeChunk(done, 't', 0, outcome(10, 'a\n'));
    await own.completeChunk(done, 't', 0, outcome(10, 'a\n')); // a rerun does not count twice
    expect(await own.backlogItems()).toBe(50);
    await own.completeChunk(done, 't', 1, outcome(10, 'b\n'));
    await own.completeChunk(failed, 't', 0, outcome(10, 'c\n'));
    await own.fail(failed, 'KF_CHUNK_FAILED');
    await own.cancel(cancelled);
    expect(await own.backlogItems()).toBe(0);
    // A batch that ended takes no more chunks (an upload still running when it was cancelled).
    await expect(own.addChunk(cancelled, 1, Buffer.from('x'), 10)).rejects.toMatchObject({ code: 'KF_UPLOAD_ABORTED' });
    expect(await own.backlogItems()).toBe(0);
  });
});

describe('the chunk processor', () => {
  it('a rerun of a chunk whose first run completed the batch (and died before saying so) announces the end', async () => {
    const id = await batchWithChunks(1);
    await store.seal(id);
    expect(await store.completeChunk(id, 't', 0, outcome(10, 'a\n'))).toBe('completed');
    const ended: string[] = [];
    // Nothing runs for a chunk counted already: no key, no thread.
    const unused = new Proxy({}, { get: () => { throw new Error('not used for a chunk counted already'); } }) as never;
    const registry = new Registry();
    const processChunk = createChunkProcessor({
      batches: store, keyCache: unused, keyPolicy: unused, pool: unused, formatter: undefined, maxItemBytes: 1024,
      logger: createLogger({ level: 'silent', name: 'test' }),
      metrics: new WorkerMetrics(registry, { busySeconds: 0, queueSize: 0, threads: 1 }),
      onBatchEnded: (batchId) => void ended.push(batchId),
    });
    const data: ChunkJobData = { batchId: id, tenant: 't', chunk: 0, firstIndex: 0, count: 10, op: 'encrypt', key: 'k', encoding: 'utf8', resultFormat: 'records', sealedFor: 'tenant' };
    expect((await processChunk({ id: 'rerun', data } as Job<ChunkJobData>)).completion).toBe('duplicate');
    expect(ended).toEqual([id]);
    // Counted as the rerun it is, not as a chunk of a batch that ended.
    expect(await registry.metrics()).toMatch(/keyfleet_chunks_total\{outcome="duplicate"[^}]*\} 1/);
  });

  it('finishes a chunk that ended its batch only once the batch’s webhook is enqueued', async () => {
    const id = await batchWithChunks(1);
    await store.seal(id);
    expect(await store.completeChunk(id, 't', 0, outcome(10, 'a\n'))).toBe('completed');
    let enqueued = false;
    const unused = new Proxy({}, { get: () => { throw new Error('not used for a chunk counted already'); } }) as never;
    const processChunk = createChunkProcessor({
      batches: store, keyCache: unused, keyPolicy: unused, pool: unused, formatter: undefined, maxItemBytes: 1024,
      logger: createLogger({ level: 'silent', name: 'test' }),
      metrics: new WorkerMetrics(new Registry(), { busySeconds: 0, queueSize: 0, threads: 1 }),
      // The enqueue takes a Redis round trip or two: a job marked done before it could lose the webhook.
      onBatchEnded: () => new Promise<void>((resolve) => setTimeout(() => resolve(void (enqueued = true)), 50)),
    });
    const data: ChunkJobData = { batchId: id, tenant: 't', chunk: 0, firstIndex: 0, count: 10, op: 'encrypt', key: 'k', encoding: 'utf8', resultFormat: 'records', sealedFor: 'tenant' };
    expect((await processChunk({ id: 'rerun', data } as Job<ChunkJobData>)).completion).toBe('duplicate');
    expect(enqueued).toBe(true);
  });

  it('fails a chunk whose batch’s webhook Redis refused to enqueue, so that its rerun announces the end again', async () => {
    const id = await batchWithChunks(1);
    await store.seal(id);
    expect(await store.completeChunk(id, 't', 0, outcome(10, 'a\n'))).toBe('completed');
    const unused = new Proxy({}, { get: () => { throw new Error('not used for a chunk counted already'); } }) as never;
    let refuse = true;
    const announced: string[] = [];
    const processChunk = createChunkProcessor({
      batches: store, keyCache: unused, keyPolicy: unused, pool: unused, formatter: undefined, maxItemBytes: 1024,
      logger: createLogger({ level: 'silent', name: 'test' }),
      metrics: new WorkerMetrics(new Registry(), { busySeconds: 0, queueSize: 0, threads: 1 }),
      onBatchEnded: async (batchId) => {
        if (refuse) throw new Error('OOM command not allowed when used memory > maxmemory');
        announced.push(batchId);
      },
    });
    const data: ChunkJobData = { batchId: id, tenant: 't', chunk: 0, firstIndex: 0, count: 10, op: 'encrypt', key: 'k', encoding: 'utf8', resultFormat: 'records', sealedFor: 'tenant' };
    await expect(processChunk({ id: 'ended', data } as Job<ChunkJobData>)).rejects.toThrow(/OOM/);
    refuse = false;
    expect((await processChunk({ id: 'ended', data } as Job<ChunkJobData>)).completion).toBe('duplicate');
    expect(announced).toEqual([id]);
  });

  it('the webhook sender tells the worker when Redis refused a delivery, and only logs it for the API', async () => {
    const id = await store.create({ tenant: 't', op: 'encrypt', key: 'k', encoding: 'utf8', chunkItems: 10, callbackUrl: 'https://hooks.example.com/kf' }, 1000);
    await store.addChunk(id, 0, Buffer.from('input-0'), 10);
    await store.seal(id);
    await store.completeChunk(id, 't', 0, outcome(10, 'a\n'));
    // A queue whose writes Redis refuses (out of memory): the enqueue's only Redis write fails.
    const refusing = { add: async () => { throw new Error('OOM command not allowed when used memory > maxmemory'); }, close: async () => {} } as unknown as Queue<WebhookJobData>;
    const lines: string[] = [];
    const logger = createLogger({ level: 'warn', name: 'test', destination: { write: (line: string) => void lines.push(line) } });
    const sender = new WebhookSender(refusing, { secret: 'webhook-secret-0123456789', allowedHosts: [], logger });
    await expect(sender.enqueue(store, id)).rejects.toThrow(/OOM/);
    sender.deliver(store, id);
    await sender.close(); // waits for the delivery in flight
    expect(lines.map((l) => JSON.parse(l).msg)).toEqual(['webhook not delivered']);
  });
});
