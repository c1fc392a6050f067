import type { Result } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { CATALOGUE, KeyfleetError, type ErrorCode } from './errors.js';
import type { Encoding } from './crypto/items.js';
import type { Redis, RedisKeys } from './redis.js';
import type { BatchOp, BatchStatus, BatchStatusBody } from './schemas.js';

// All keys of one batch share the `{hash tag}` prefix, so each script runs in one cluster slot.
// Progress is accounted only by these scripts; the `done` bitmap makes a chunk count once.
const ADD_CHUNK = `
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('HINCRBY', KEYS[1], 'total', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'chunks', 1)
redis.call('INCRBY', KEYS[3], ARGV[3])
return 1`;

const COMPLETE_CHUNK = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'cancelled' or status == 'failed' then return -2 end
if redis.call('SETBIT', KEYS[4], ARGV[1], 1) == 1 then return 0 end
local ttl = tonumber(ARGV[6])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[5])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'processed', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'succeeded', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'failed', ARGV[4])
local done = redis.call('HINCRBY', KEYS[1], 'chunksDone', 1)
redis.call('DECRBY', KEYS[5], ARGV[2])
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('EXPIRE', KEYS[4], ttl)
if status == 'queued' then redis.call('HSET', KEYS[1], 'status', 'running', 'startedAt', ARGV[7]) end
if redis.call('HGET', KEYS[1], 'sealed') == '1' and done == tonumber(redis.call('HGET', KEYS[1], 'chunks')) then
  redis.call('HSET', KEYS[1], 'status', 'completed', 'finishedAt', ARGV[7])
  redis.call('EXPIRE', KEYS[1], ttl)
  redis.call('PUBLISH', ARGV[8], 'completed')
  return 2
end
redis.call('PUBLISH', ARGV[8], 'progress')
return 1`;

const SEAL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'cancelled' or status == 'failed' then return -2 end
redis.call('HSET', KEYS[1], 'sealed', 1)
if tonumber(redis.call('HGET', KEYS[1], 'chunksDone')) == tonumber(redis.call('HGET', KEYS[1], 'chunks')) then
  redis.call('HSET', KEYS[1], 'status', 'completed', 'finishedAt', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('PUBLISH', ARGV[2], 'completed')
  return 2
end
redis.call('PUBLISH', ARGV[2], 'progress')
return 1`;

const FAIL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' or status == 'cancelled' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'errorCode', ARGV[1], 'errorMessage', ARGV[2], 'finishedAt', ARGV[3])
redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[1], 'total')) - tonumber(redis.call('HGET', KEYS[1], 'processed')))
redis.call('DEL', KEYS[2])
redis.call('PUBLISH', ARGV[4], 'failed')
return 1`;

const CANCEL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
local changed = 0
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finishedAt', ARGV[1])
  redis.call('DECRBY', KEYS[5], tonumber(redis.call('HGET', KEYS[1], 'total')) - tonumber(redis.call('HGET', KEYS[1], 'processed')))
  changed = 1
end
redis.call('HSET', KEYS[1], 'deleted', 1)
redis.call('UNLINK', KEYS[2], KEYS[3], KEYS[4])
redis.call('PUBLISH', ARGV[2], 'cancelled')
return changed`;

declare module 'ioredis' {
  interface RedisCommander<Context> {
    kfChunkAdd(meta: string, inputs: string, backlog: string, chunk: number, packed: Buffer, count: number, ttl: number): Result<number, Context>;
    kfChunkComplete(meta: string, inputs: string, results: string, done: string, backlog: string, chunk: number, count: number, succeeded: number, failed: number, lines: Buffer, ttl: number, now: string, channel: string): Result<number, Context>;
    kfBatchSeal(meta: string, now: string, channel: string, ttl: number): Result<number, Context>;
    kfBatchFail(meta: string, inputs: string, backlog: string, code: string, message: string, now: string, channel: string): Result<number, Context>;
    kfBatchCancel(meta: string, inputs: string, results: string, done: string, backlog: string, now: string, channel: string): Result<number, Context>;
  }
}

export interface BatchSpec {
  readonly tenant: string;
  readonly op: BatchOp;
  readonly key: string;
  readonly encoding: Encoding;
  readonly requestId?: string;
  /** Items per chunk (the last may hold fewer): lets results be read from any item on. */
  readonly chunkItems: number;
}

export interface BatchRecord extends BatchStatusBody {
  readonly tenant: string;
  readonly encoding: Encoding;
  readonly chunks: number;
  readonly chunkItems: number;
  readonly sealed: boolean;
  readonly deleted: boolean;
}

/** What a chunk's completion did to its batch. */
export type ChunkCompletion = 'progress' | 'completed' | 'duplicate' | 'batch-gone' | 'batch-ended';

const COMPLETION: Record<string, ChunkCompletion> = { '1': 'progress', '2': 'completed', '0': 'duplicate', '-1': 'batch-gone', '-2': 'batch-ended' };

/** Batch metadata, chunk inputs and chunk results in Redis. */
export class BatchStore {
  readonly #redis: Redis;
  readonly #keys: RedisKeys;
  readonly #ttl: number;

  constructor(redis: Redis, keys: RedisKeys, resultTtlSeconds: number) {
    this.#redis = redis;
    this.#keys = keys;
    this.#ttl = resultTtlSeconds;
    redis.defineCommand('kfChunkAdd', { numberOfKeys: 3, lua: ADD_CHUNK });
    redis.defineCommand('kfChunkComplete', { numberOfKeys: 5, lua: COMPLETE_CHUNK });
    redis.defineCommand('kfBatchSeal', { numberOfKeys: 1, lua: SEAL });
    redis.defineCommand('kfBatchFail', { numberOfKeys: 3, lua: FAIL });
    redis.defineCommand('kfBatchCancel', { numberOfKeys: 5, lua: CANCEL });
  }

  async create(spec: BatchSpec): Promise<string> {
    const id = randomBytes(12).toString('base64url');
    const meta = this.#keys.batch(id);
    await this.#redis
      .multi()
      .hset(meta, {
        id, tenant: spec.tenant, op: spec.op, key: spec.key, encoding: spec.encoding, chunkItems: spec.chunkItems, status: 'queued',
        total: 0, processed: 0, succeeded: 0, failed: 0, chunks: 0, chunksDone: 0, sealed: 0, createdAt: new Date().toISOString(),
      })
      // An abandoned batch (its API died mid-upload) still disappears in time.
      .expire(meta, this.#ttl)
      .exec();
    return id;
  }

  /** Stores one chunk's packed inputs and counts it, in one round trip; refused once the batch has ended. */
  async addChunk(id: string, chunk: number, packed: Buffer, count: number): Promise<void> {
    const k = this.#keys;
    const added = await this.#redis.kfChunkAdd(k.batch(id), k.batchInputs(id), k.backlogItems(), chunk, packed, count, this.#ttl);
    if (added !== 1) throw new KeyfleetError('KF_UPLOAD_ABORTED', 'the batch ended (cancelled or failed) during its upload');
  }

  /** Items stored and not yet processed, over every batch. */
  async backlogItems(): Promise<number> {
    return Math.max(0, Number((await this.#redis.get(this.#keys.backlogItems())) ?? 0));
  }

  /** Marks the upload complete: from now on the last chunk to finish completes the batch. */
  async seal(id: string): Promise<void> {
    await this.#redis.kfBatchSeal(this.#keys.batch(id), new Date().toISOString(), this.#keys.batchEvents(id), this.#ttl);
  }

  readInput(id: string, chunk: number): Promise<Buffer | null> {
    return this.#redis.hgetBuffer(this.#keys.batchInputs(id), String(chunk));
  }

  readResults(id: string, chunk: number): Promise<Buffer | null> {
    return this.#redis.hgetBuffer(this.#keys.batchResults(id), String(chunk));
  }

  async completeChunk(id: string, chunk: number, outcome: { count: number; succeeded: number; failed: number; lines: Buffer }): Promise<ChunkCompletion> {
    const k = this.#keys;
    const result = await this.#redis.kfChunkComplete(
      k.batch(id), k.batchInputs(id), k.batchResults(id), k.batchDone(id), k.backlogItems(),
      chunk, outcome.count, outcome.succeeded, outcome.failed, outcome.lines, this.#ttl, new Date().toISOString(), k.batchEvents(id),
    );
    return COMPLETION[String(result)] ?? 'progress';
  }

  /** Ends a batch as failed (once); later chunk completions are ignored. */
  async fail(id: string, code: ErrorCode, message: string = CATALOGUE[code].message): Promise<boolean> {
    const k = this.#keys;
    return (await this.#redis.kfBatchFail(k.batch(id), k.batchInputs(id), k.backlogItems(), code, message, new Date().toISOString(), k.batchEvents(id))) === 1;
  }

  /** Cancels what has not run and deletes inputs and results; the status record stays until its TTL. */
  async cancel(id: string): Promise<void> {
    const k = this.#keys;
    const result = await this.#redis.kfBatchCancel(k.batch(id), k.batchInputs(id), k.batchResults(id), k.batchDone(id), k.backlogItems(), new Date().toISOString(), k.batchEvents(id));
    if (result === -1) throw new KeyfleetError('KF_BATCH_NOT_FOUND');
  }

  async get(id: string): Promise<BatchRecord | undefined> {
    const f = await this.#redis.hgetall(this.#keys.batch(id));
    if (!f['id']) return undefined;
    const n = (name: string) => Number(f[name] ?? 0);
    return {
      id: f['id'],
      tenant: f['tenant'] ?? '',
      op: f['op'] as BatchOp,
      key: f['key'] ?? '',
      encoding: (f['encoding'] ?? 'utf8') as Encoding,
      status: f['status'] as BatchStatus,
      total: n('total'),
      processed: n('processed'),
      succeeded: n('succeeded'),
      failed: n('failed'),
      createdAt: f['createdAt'] ?? '',
      ...(f['finishedAt'] ? { finishedAt: f['finishedAt'] } : {}),
      ...(f['errorCode'] ? { error: { code: f['errorCode'], message: f['errorMessage'] ?? '' } } : {}),
      chunks: n('chunks'),
      chunkItems: n('chunkItems'),
      sealed: f['sealed'] === '1',
      deleted: f['deleted'] === '1',
    };
  }
}

/** The public view of a batch: what GET /v1/batches/{id} answers. */
export function publicStatus(record: BatchRecord): BatchStatusBody {
  const { tenant: _t, encoding: _e, chunks: _c, chunkItems: _ci, sealed: _s, deleted: _d, ...body } = record;
  return body;
}
