import type { Result } from 'ioredis';
import { randomBytes } from 'node:crypto';
import type { AtRestSealer } from './at-rest.js';
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
redis.call('PEXPIRE', KEYS[4], ARGV[5])
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
redis.call('DEL', KEYS[2])
if tonumber(redis.call('HGET', KEYS[1], 'chunksDone')) == tonumber(redis.call('HGET', KEYS[1], 'chunks')) then
  redis.call('HSET', KEYS[1], 'status', 'completed', 'finishedAt', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('PUBLISH', ARGV[2], 'completed')
  return 2
end
redis.call('PUBLISH', ARGV[2], 'progress')
return 1`;

// With ARGV[5] = '1' it fails the batch only if its upload was abandoned: unsealed, no live upload.
const FAIL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' or status == 'cancelled' then return 0 end
if ARGV[5] == '1' and (redis.call('HGET', KEYS[1], 'sealed') == '1' or redis.call('EXISTS', KEYS[4]) == 1) then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'errorCode', ARGV[1], 'errorMessage', ARGV[2], 'finishedAt', ARGV[3])
redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[1], 'total')) - tonumber(redis.call('HGET', KEYS[1], 'processed')))
redis.call('DEL', KEYS[2], KEYS[4])
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
redis.call('UNLINK', KEYS[2], KEYS[3], KEYS[4], KEYS[6])
redis.call('PUBLISH', ARGV[2], 'cancelled')
return changed`;

// Admission: counts the tenant's batches still queued or running (forgetting ended ones) and
// creates the new one only below the limit, atomically. Batch meta keys are built from ARGV[1];
// they share the prefix's {hash tag}, so the script stays in one cluster slot.
const CREATE = `
local active = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local status = redis.call('HGET', ARGV[1] .. id, 'status')
  if status == 'queued' or status == 'running' then active = active + 1 else redis.call('SREM', KEYS[1], id) end
end
if active >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], 1, 'PX', ARGV[4])
redis.call('SADD', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1`;

declare module 'ioredis' {
  interface RedisCommander<Context> {
    kfBatchCreate(tenantBatches: string, meta: string, upload: string, metaPrefix: string, limit: number, ttl: number, leaseMs: number, id: string, ...fields: Array<string | number>): Result<number, Context>;
    kfChunkAdd(meta: string, inputs: string, backlog: string, upload: string, chunk: number, packed: Buffer, count: number, ttl: number, leaseMs: number): Result<number, Context>;
    kfChunkComplete(meta: string, inputs: string, results: string, done: string, backlog: string, chunk: number, count: number, succeeded: number, failed: number, lines: Buffer, ttl: number, now: string, channel: string): Result<number, Context>;
    kfBatchSeal(meta: string, upload: string, now: string, channel: string, ttl: number): Result<number, Context>;
    kfBatchFail(meta: string, inputs: string, backlog: string, upload: string, code: string, message: string, now: string, channel: string, onlyIfAbandoned: '0' | '1'): Result<number, Context>;
    kfBatchCancel(meta: string, inputs: string, results: string, done: string, backlog: string, upload: string, now: string, channel: string): Result<number, Context>;
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

export interface BatchStoreOptions {
  /** How long status, inputs and results stay (RESULT_TTL_SECONDS). */
  readonly resultTtlSeconds: number;
  /**
   * How long an upload stays alive without news (UPLOAD_IDLE_SECONDS): every stored chunk and
   * the upload's keep-alive renew it. An unsealed batch whose lease lapsed lost its upload.
   */
  readonly uploadIdleSeconds: number;
  /** Seals chunk inputs and results at rest. */
  readonly sealer: AtRestSealer;
}

/**
 * Batch metadata, chunk inputs and chunk results in Redis. Inputs and results are sealed at
 * rest under the batch's own data key (AtRestSealer): Redis never holds a batch's plaintexts.
 */
export class BatchStore {
  readonly #redis: Redis;
  readonly #keys: RedisKeys;
  readonly #ttl: number;
  readonly #leaseMs: number;
  readonly #sealer: AtRestSealer;

  constructor(redis: Redis, keys: RedisKeys, { resultTtlSeconds, uploadIdleSeconds, sealer }: BatchStoreOptions) {
    this.#redis = redis;
    this.#keys = keys;
    this.#ttl = resultTtlSeconds;
    this.#leaseMs = uploadIdleSeconds * 1000;
    this.#sealer = sealer;
    redis.defineCommand('kfBatchCreate', { numberOfKeys: 3, lua: CREATE });
    redis.defineCommand('kfChunkAdd', { numberOfKeys: 4, lua: ADD_CHUNK });
    redis.defineCommand('kfChunkComplete', { numberOfKeys: 5, lua: COMPLETE_CHUNK });
    redis.defineCommand('kfBatchSeal', { numberOfKeys: 2, lua: SEAL });
    redis.defineCommand('kfBatchFail', { numberOfKeys: 4, lua: FAIL });
    redis.defineCommand('kfBatchCancel', { numberOfKeys: 6, lua: CANCEL });
  }

  /**
   * Creates a batch, unless its tenant already has `maxActive` batches queued or running
   * (429). Abandoned uploads among them are failed first, so a dead API never holds a slot.
   */
  async create(spec: BatchSpec, maxActive: number): Promise<string> {
    const k = this.#keys;
    const members = await this.#redis.smembers(k.tenantBatches(spec.tenant));
    if (members.length >= maxActive) await Promise.all(members.map((id) => this.failIfAbandoned(id)));
    const id = randomBytes(12).toString('base64url');
    const fields = {
      id, tenant: spec.tenant, op: spec.op, key: spec.key, encoding: spec.encoding, chunkItems: spec.chunkItems, status: 'queued',
      total: 0, processed: 0, succeeded: 0, failed: 0, chunks: 0, chunksDone: 0, sealed: 0, createdAt: new Date().toISOString(),
    };
    // The meta key expires, so even a batch nobody reaps disappears in time.
    const created = await this.#redis.kfBatchCreate(
      k.tenantBatches(spec.tenant), k.batch(id), k.batchUpload(id), k.batch(''), maxActive, this.#ttl, this.#leaseMs, id, ...Object.entries(fields).flat(),
    );
    if (created !== 1) {
      throw new KeyfleetError('KF_TOO_MANY_BATCHES', `the tenant has ${maxActive} batches queued or running, the most allowed; retry when one ends`, { retryAfterSeconds: 5 });
    }
    return id;
  }

  /** Stores one chunk's inputs (sealed) and counts it, in one round trip; refused once the batch has ended. */
  async addChunk(id: string, chunk: number, packed: Buffer, count: number): Promise<void> {
    const k = this.#keys;
    const sealed = this.#sealer.seal('batch', id, `in:${chunk}`, packed);
    const added = await this.#redis.kfChunkAdd(k.batch(id), k.batchInputs(id), k.backlogItems(), k.batchUpload(id), chunk, sealed, count, this.#ttl, this.#leaseMs);
    if (added !== 1) throw new KeyfleetError('KF_UPLOAD_ABORTED', 'the batch ended (cancelled or failed) during its upload');
  }

  /** How often an upload should renew its lease: well inside it. */
  get keepAliveMs(): number {
    return Math.min(10_000, this.#leaseMs / 3);
  }

  /** Renews the upload's lease while a slow body is still arriving. */
  async touchUpload(id: string): Promise<void> {
    await this.#redis.pexpire(this.#keys.batchUpload(id), this.#leaseMs);
  }

  /** Fails the batch as KF_UPLOAD_ABORTED if its upload was abandoned (unsealed, lease lapsed). */
  async failIfAbandoned(id: string): Promise<boolean> {
    const k = this.#keys;
    const message = 'the upload stopped before it was complete (its connection or API process died); nothing of it was processed as complete';
    return (await this.#redis.kfBatchFail(k.batch(id), k.batchInputs(id), k.backlogItems(), k.batchUpload(id), 'KF_UPLOAD_ABORTED', message, new Date().toISOString(), k.batchEvents(id), '1')) === 1;
  }

  /** Items stored and not yet processed, over every batch. */
  async backlogItems(): Promise<number> {
    return Math.max(0, Number((await this.#redis.get(this.#keys.backlogItems())) ?? 0));
  }

  /** Marks the upload complete: from now on the last chunk to finish completes the batch. */
  async seal(id: string): Promise<void> {
    await this.#redis.kfBatchSeal(this.#keys.batch(id), this.#keys.batchUpload(id), new Date().toISOString(), this.#keys.batchEvents(id), this.#ttl);
  }

  /** The chunk's packed inputs, opened; null once counted, cancelled or expired. */
  async readInput(id: string, chunk: number): Promise<Buffer | null> {
    const sealed = await this.#redis.hgetBuffer(this.#keys.batchInputs(id), String(chunk));
    return sealed && this.#sealer.open('batch', id, `in:${chunk}`, sealed);
  }

  /** The chunk's NDJSON result lines, opened; null when deleted or expired. */
  async readResults(id: string, chunk: number): Promise<Buffer | null> {
    const sealed = await this.#redis.hgetBuffer(this.#keys.batchResults(id), String(chunk));
    return sealed && this.#sealer.open('batch', id, `out:${chunk}`, sealed);
  }

  async completeChunk(id: string, chunk: number, outcome: { count: number; succeeded: number; failed: number; lines: Buffer }): Promise<ChunkCompletion> {
    const k = this.#keys;
    const result = await this.#redis.kfChunkComplete(
      k.batch(id), k.batchInputs(id), k.batchResults(id), k.batchDone(id), k.backlogItems(),
      chunk, outcome.count, outcome.succeeded, outcome.failed, this.#sealer.seal('batch', id, `out:${chunk}`, outcome.lines), this.#ttl, new Date().toISOString(), k.batchEvents(id),
    );
    return COMPLETION[String(result)] ?? 'progress';
  }

  /** Ends a batch as failed (once); later chunk completions are ignored. */
  async fail(id: string, code: ErrorCode, message: string = CATALOGUE[code].message): Promise<boolean> {
    const k = this.#keys;
    return (await this.#redis.kfBatchFail(k.batch(id), k.batchInputs(id), k.backlogItems(), k.batchUpload(id), code, message, new Date().toISOString(), k.batchEvents(id), '0')) === 1;
  }

  /** Cancels what has not run and deletes inputs and results; the status record stays until its TTL. */
  async cancel(id: string): Promise<void> {
    const k = this.#keys;
    const result = await this.#redis.kfBatchCancel(k.batch(id), k.batchInputs(id), k.batchResults(id), k.batchDone(id), k.backlogItems(), k.batchUpload(id), new Date().toISOString(), k.batchEvents(id));
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
