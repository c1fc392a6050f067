import { Command, type ChainableCommander } from 'ioredis';
import { randomBytes } from 'node:crypto';
import type { AtRestSealer } from './at-rest.js';
import { defineBatchScripts } from './batch-scripts.js';
import { CATALOGUE, KeyfleetError, type ErrorCode } from './errors.js';
import { Handover } from './handover.js';
import type { Encoding } from './crypto/items.js';
import type { Redis, RedisKeys } from './redis.js';
import type { BatchOp, BatchStatus, BatchStatusBody } from './schemas.js';

export interface BatchSpec {
  readonly tenant: string;
  readonly op: BatchOp;
  readonly key: string;
  readonly encoding: Encoding;
  readonly requestId?: string;
  /** Items per chunk (the last may hold fewer): lets results be read from any item on. */
  readonly chunkItems: number;
  /** Where the final status is POSTed (checked by checkCallbackUrl). */
  readonly callbackUrl?: string;
  /** Bound into every item's associated data. */
  readonly context?: string;
  /** Rewrap into this key (migration). */
  readonly targetKey?: string;
}

export interface BatchRecord extends BatchStatusBody {
  readonly tenant: string;
  readonly encoding: Encoding;
  readonly chunks: number;
  readonly chunkItems: number;
  /** Its chunks' first items are recorded (`RedisKeys.batchStarts`): every batch stored since chunks could close by bytes. */
  readonly chunkStarts: boolean;
  readonly callbackUrl?: string;
  readonly sealed: boolean;
  readonly deleted: boolean;
  /** Its inputs, results and context are sealed for its tenant too (`batchOwner`); not by an earlier API. */
  readonly bound: boolean;
}

/**
 * Whose a batch's sealed data is, for BatchStore's methods that seal and open it: its tenant,
 * or undefined for a batch of an earlier API (sealed for the batch alone). Bound to the tenant,
 * a batch moved to another tenant by a write to Redis (its record's `tenant`) does not open.
 */
export const batchOwner = (batch: Pick<BatchRecord, 'tenant' | 'bound'>): string | undefined => (batch.bound ? batch.tenant : undefined);

/** `batchOwner` as a chunk job says it (startChunk holds the claim against the record). */
export const jobOwner = (job: Pick<ChunkJobClaims, 'tenant' | 'sealedFor'>): string | undefined => batchOwner({ tenant: job.tenant, bound: job.sealedFor === 'tenant' });

/** The id that batch data is sealed under: the batch's, and its tenant's where it is bound. */
const sealId = (id: string, owner: string | undefined): string => (owner === undefined ? id : `${id}@${owner}`);

/**
 * What a chunk's completion did to its batch; or, for a chunk with nothing to run, what became
 * of it: `input-lost` means its input expired before it ran, and its batch failed for it.
 */
export type ChunkCompletion = 'progress' | 'completed' | 'duplicate' | 'batch-gone' | 'batch-ended' | 'input-lost';

/** What a chunk's job says of its batch (startChunk holds it against the batch's record). */
export interface ChunkJobClaims {
  readonly tenant: string;
  readonly op: BatchOp;
  readonly key: string;
  readonly encoding: Encoding;
  /** The batch's context, sealed for the batch (so it cannot come from another one). */
  readonly sealedContext?: string | undefined;
  /** A context in the clear, as an earlier API's jobs carry it. */
  readonly context?: string | undefined;
  readonly targetKey?: string | undefined;
  /** `tenant` where the batch's data is sealed for its tenant (`batchOwner`). */
  readonly sealedFor?: 'tenant' | undefined;
}

/** Whether a chunk job says of its batch what the batch's record does. */
function jobMatches(job: ChunkJobClaims, [tenant, op, key, encoding, ctx, targetKey, bound]: Array<string | null>): boolean {
  if (tenant !== job.tenant || op !== job.op || key !== job.key || encoding !== job.encoding) return false;
  // Whose its data is sealed for, as the worker opens and seals it (an earlier API's: the batch's alone).
  if ((job.sealedFor === 'tenant') !== (bound === '1')) return false;
  // An earlier API's record says nothing of context or target key.
  if (ctx === null) return true;
  return !job.context && (job.sealedContext !== undefined) === (ctx === '1') && (job.targetKey ?? null) === targetKey;
}

const COMPLETION: Record<string, ChunkCompletion> = { '1': 'progress', '2': 'completed', '0': 'duplicate', '-1': 'batch-gone', '-2': 'batch-ended', '3': 'input-lost' };

const ENDED_DURING_UPLOAD = 'the batch ended (cancelled or failed) during its upload';

/** The least time an open batch (queued or running) lives after its last news: a week. */
export const OPEN_BATCH_SECONDS = 7 * 86_400;
/** Batches a tenant's listing keeps, the newest by creation (GET /v1/batches). */
export const BATCH_INDEX_MAX = 10_000;

export interface BatchStoreOptions {
  /** How long a batch's status and results stay once it ended: completed, failed or cancelled (RESULT_TTL_SECONDS). */
  readonly resultTtlSeconds: number;
  /**
   * How long a batch still queued or running lives after its last news (a stored or a completed
   * chunk): only a batch that nothing happened to for this long is dropped, and its queued chunks
   * then just leave the backlog. Chunk inputs and results live twice this from their write.
   * Default: the greater of resultTtlSeconds and OPEN_BATCH_SECONDS.
   */
  readonly openBatchTtlSeconds?: number;
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
  readonly #openTtl: number;
  readonly #chunkTtl: number;
  readonly #leaseMs: number;
  readonly #keepAliveMs: number;
  readonly #sealer: AtRestSealer;

  constructor(redis: Redis, keys: RedisKeys, { resultTtlSeconds, openBatchTtlSeconds, uploadIdleSeconds, sealer }: BatchStoreOptions) {
    this.#redis = redis;
    this.#keys = keys;
    this.#ttl = resultTtlSeconds;
    this.#openTtl = openBatchTtlSeconds ?? Math.max(resultTtlSeconds, OPEN_BATCH_SECONDS);
    // Longer than the record's: a queued chunk whose batch record expired still finds its input,
    // and by deleting it takes its items out of the backlog (batch-scripts.ts, Lifetimes).
    this.#chunkTtl = 2 * this.#openTtl;
    // An upload renews its lease as pieces of its body arrive, at most every keepAliveMs, and
    // the pieces may come up to UPLOAD_IDLE_SECONDS apart: the lease outlasts both together,
    // with a renewal to spare, or a live upload that paused could count as abandoned.
    const idleMs = uploadIdleSeconds * 1000;
    // Whole milliseconds: Redis takes no other for PX.
    this.#keepAliveMs = Math.min(10_000, Math.floor(idleMs / 3));
    this.#leaseMs = idleMs + 2 * this.#keepAliveMs;
    this.#sealer = sealer;
    defineBatchScripts(redis);
  }

  /**
   * Creates a batch, unless its tenant already has `maxActive` batches queued or running
   * (429). Abandoned uploads among them are failed first, so a dead API never holds a slot.
   */
  async create(spec: BatchSpec, maxActive: number): Promise<string> {
    const k = this.#keys;
    const members = await this.#redis.smembers(k.tenantBatches(spec.tenant));
    if (members.length >= maxActive) await Promise.all(members.map((id) => this.failIfAbandoned(id)));
    // Not starting with '-' (or '_'): on a command line, `keyfleet batch status -x…` reads as an option.
    let id: string;
    do id = randomBytes(12).toString('base64url');
    while (id[0] === '-' || id[0] === '_');
    const now = new Date();
    const fields = {
      id, tenant: spec.tenant, op: spec.op, key: spec.key, encoding: spec.encoding, chunkItems: spec.chunkItems, chunkStarts: 1, status: 'queued',
      total: 0, processed: 0, succeeded: 0, failed: 0, chunks: 0, chunksDone: 0, sealed: 0, createdAt: now.toISOString(),
      ...(spec.callbackUrl ? { callbackUrl: spec.callbackUrl } : {}),
      // What its chunk jobs must say of context and target key (startChunk); a record without
      // `ctx` is an earlier API's, whose jobs are not held to these two.
      ctx: spec.context === undefined ? 0 : 1,
      ...(spec.targetKey ? { targetKey: spec.targetKey } : {}),
      bound: 1,
    };
    // The record expires, so even a batch nobody reaps disappears in time; its results clock starts when it ends.
    const created = await this.#redis.kfBatchCreate(
      k.tenantBatches(spec.tenant), k.batch(id), k.batchUpload(id), k.batchIndex(spec.tenant), k.batch(''), maxActive, this.#openTtl, this.#leaseMs, id,
      now.getTime(), BATCH_INDEX_MAX, ...Object.entries(fields).flat(),
    );
    if (created !== 1) {
      throw new KeyfleetError('KF_TOO_MANY_BATCHES', `the tenant has ${maxActive} batches queued or running, the most allowed; retry when one ends`, { retryAfterSeconds: 5 });
    }
    return id;
  }

  /**
   * Stores one chunk's inputs (sealed) and counts it, in one round trip; refused once the batch
   * has ended. Every chunk before it holds `count` items too.
   */
  async addChunk(id: string, chunk: number, packed: Buffer, count: number): Promise<void> {
    const [tenant, bound] = await this.#redis.hmget(this.#keys.batch(id), 'tenant', 'bound');
    const owner = batchOwner({ tenant: tenant ?? '', bound: bound === '1' });
    await this.addSealedChunk(id, chunk, this.#sealer.seal('batch', sealId(id, owner), `in:${chunk}`, packed), count, chunk * count);
  }

  /**
   * A chunk's packed inputs sealed into `out` (at least `packed.length + SEAL_OVERHEAD` bytes)
   * for `addSealedChunk`; the bytes written. The caller may reuse `packed` at once.
   */
  sealInputInto(id: string, owner: string | undefined, chunk: number, packed: Buffer, out: Buffer): number {
    return this.#sealer.sealInto('batch', sealId(id, owner), `in:${chunk}`, packed, out);
  }

  /**
   * A batch's context as its chunk jobs carry it: sealed like its inputs (base64), so neither
   * the job data that Bull Board shows nor a Redis dump holds it, as the logs do not.
   */
  sealContext(id: string, owner: string | undefined, context: string): string {
    return this.#sealer.seal('batch', sealId(id, owner), 'context', Buffer.from(context, 'utf8')).toString('base64');
  }

  /** `sealContext`'s context again; throws when it was not sealed for this batch (and owner). */
  openContext(id: string, owner: string | undefined, sealed: string): string {
    return this.#sealer.open('batch', sealId(id, owner), 'context', Buffer.from(sealed, 'base64')).toString('utf8');
  }

  async addSealedChunk(id: string, chunk: number, sealed: Buffer, count: number, firstIndex: number): Promise<void> {
    const k = this.#keys;
    const input = k.batchInput(id, chunk);
    const start = Buffer.allocUnsafe(4);
    start.writeUInt32BE(firstIndex);
    const added = await pipelined(
      this.#redis
        .pipeline()
        .set(input, sealed, 'EX', this.#chunkTtl)
        .kfChunkAdd(k.batch(id), input, k.backlogItems(), k.batchUpload(id), k.batchDone(id), k.batchAdded(id), k.batchStarts(id), count, this.#leaseMs, this.#openTtl, chunk, start),
    );
    if (added !== 1) throw new KeyfleetError('KF_UPLOAD_ABORTED', ENDED_DURING_UPLOAD);
  }

  /** How often an upload renews its lease, at most. */
  get keepAliveMs(): number {
    return this.#keepAliveMs;
  }

  /** Renews the upload's lease while a slow body is still arriving. */
  async touchUpload(id: string): Promise<void> {
    await this.#redis.pexpire(this.#keys.batchUpload(id), this.#leaseMs);
  }

  /**
   * Fails every abandoned upload among the tenant's queued and running batches (as
   * failIfAbandoned); the ids it failed. Any number of APIs may sweep at once: each batch fails once.
   */
  async failAbandoned(tenant: string): Promise<string[]> {
    const members = await this.#redis.smembers(this.#keys.tenantBatches(tenant));
    const failed = await Promise.all(members.map(async (id) => ((await this.failIfAbandoned(id)) ? id : undefined)));
    return failed.filter((id) => id !== undefined);
  }

  /** How often an abandoned upload is looked for (the API's sweep): as often as uploads renew their lease. */
  get abandonSweepMs(): number {
    return this.#keepAliveMs;
  }

  /** Fails the batch as KF_UPLOAD_ABORTED if its upload was abandoned (unsealed, lease lapsed). */
  async failIfAbandoned(id: string): Promise<boolean> {
    return this.#fail(id, 'KF_UPLOAD_ABORTED', 'the upload stopped before it was complete (its connection or API process died); nothing of it was processed as complete', 'abandoned');
  }

  /**
   * Fails the batch for its upload's error, unless the upload was sealed after all: a seal whose
   * reply was lost leaves a whole batch, which runs, and does not end as an aborted upload.
   */
  async failUpload(id: string, code: ErrorCode): Promise<boolean> {
    return this.#fail(id, code, CATALOGUE[code].message, 'unsealed');
  }

  /** Items stored and not yet processed, over every batch. */
  async backlogItems(): Promise<number> {
    return Math.max(0, Number((await this.#redis.get(this.#keys.backlogItems())) ?? 0));
  }

  /**
   * Marks the upload complete: from now on the last chunk to finish completes the batch. When
   * every chunk finished before this, sealing completes it (`completed`: the caller announces
   * it, as no worker will). Refused once the batch has ended (cancelled, failed, expired).
   */
  async seal(id: string): Promise<'progress' | 'completed'> {
    const k = this.#keys;
    const result = await this.#redis.kfBatchSeal(k.batch(id), k.batchUpload(id), k.batchDone(id), new Date().toISOString(), k.batchEvents(id), this.#ttl, k.batch(id));
    if (result === 2) return 'completed';
    if (result === 1) return 'progress';
    throw new KeyfleetError('KF_UPLOAD_ABORTED', ENDED_DURING_UPLOAD);
  }

  /**
   * Before a chunk runs: its packed inputs, opened; or, when there is nothing to run, what
   * became of it. A chunk whose batch is gone (expired or deleted under its queued job) takes
   * its items out of the backlog here, once however often its job runs; one whose input
   * expired while its batch was open fails the batch (`input-lost`).
   *
   * `job` is what the chunk's job says of its batch. A job's data can be edited (Bull Board's
   * actions, where they are on): a job whose tenant, op, key, encoding, context (given or not,
   * and sealed) or target key is not its batch's is `job-mismatch`, and its input stays closed
   * (else an edited job could open one tenant's batch under another's key, or seal a batch's
   * items under a context or into a key its caller did not ask for).
   */
  async startChunk(id: string, chunk: number, count: number, job: ChunkJobClaims): Promise<Buffer | ChunkCompletion | 'job-mismatch'> {
    const k = this.#keys;
    // One transaction: an input seen missing while the record exists is not a batch expiring in between.
    const [record, sealed] = ((await this.#redis.multi().hmget(k.batch(id), 'status', 'tenant', 'op', 'key', 'encoding', 'ctx', 'targetKey', 'bound').getBuffer(k.batchInput(id, chunk)).exec()) ?? []).map(([err, value]) => {
      if (err) throw err;
      return value;
    }) as [Array<string | null>, Buffer | null];
    const [status, ...described] = record;
    if (status && !jobMatches(job, described)) return 'job-mismatch';
    const owner = jobOwner(job); // the record's, as jobMatches found
    if (status && sealed) return this.#sealer.open('batch', sealId(id, owner), `in:${chunk}`, sealed);
    const message = `the input of chunk ${chunk} expired before the chunk ran (it waited more than ${this.#chunkTtl} s)`;
    const settled = await this.#redis.kfChunkSettle(k.batch(id), k.batchInput(id, chunk), k.batchDone(id), k.backlogItems(), k.batchUpload(id),
      chunk, count, 'KF_CHUNK_FAILED', message, new Date().toISOString(), k.batchEvents(id), k.batch(id), this.#ttl);
    // 1: the input is there after all (not seen in the transaction above: cannot happen, inputs are never written twice).
    if (settled === 1) return (await this.readInput(id, owner, chunk)) ?? 'duplicate';
    return COMPLETION[String(settled)] ?? 'batch-gone';
  }

  /** The chunk's packed inputs, opened; null once counted, cancelled or expired (a chunk about to run: startChunk). */
  async readInput(id: string, owner: string | undefined, chunk: number): Promise<Buffer | null> {
    const sealed = await this.#redis.getBuffer(this.#keys.batchInput(id, chunk));
    return sealed && this.#sealer.open('batch', sealId(id, owner), `in:${chunk}`, sealed);
  }

  /**
   * Where each chunk of the batch starts, as stored. A batch stored before chunks could close by
   * bytes has no record of it: there every chunk but the last holds `chunkItems` items. A record
   * that should be there and is not (deleted with the results, evicted) is KF_BATCH_DELETED,
   * never a guess that would number the results wrongly.
   */
  async chunkLayout(batch: BatchRecord): Promise<ChunkLayout> {
    if (!batch.chunkStarts) return new EvenChunks(batch.chunkItems);
    const raw = await this.#redis.getBuffer(this.#keys.batchStarts(batch.id));
    if (raw && raw.length >= batch.chunks * 4) return new StoredChunkStarts(raw, batch.chunks);
    throw new KeyfleetError('KF_BATCH_DELETED');
  }

  /**
   * Which chunks ran to completion (their bits in the batch's `done` bitmap, first chunk first):
   * of a batch that failed, only those have results.
   */
  async chunksRan(id: string): Promise<(chunk: number) => boolean> {
    const bits = (await this.#redis.getBuffer(this.#keys.batchDone(id))) ?? Buffer.alloc(0);
    return (chunk) => ((bits[chunk >> 3] ?? 0) & (0x80 >> (chunk & 7))) !== 0;
  }

  /**
   * The chunk's stored results (shared/result-codec.ts), opened; null when deleted or expired.
   * Handed over, so that neither this promise nor ioredis's keeps them once taken (a reader that reads ahead).
   */
  async readResults(id: string, owner: string | undefined, chunk: number): Promise<Handover<Buffer | null>> {
    const reply = (await this.#redis.sendCommand(new HandedOverGet(this.#keys.batchResult(id, chunk)))) as Handover<Buffer | null>;
    const sealed = reply.take();
    return new Handover(sealed && this.#sealer.open('batch', sealId(id, owner), `out:${chunk}`, sealed));
  }

  async completeChunk(id: string, owner: string | undefined, chunk: number, outcome: { count: number; succeeded: number; failed: number; results: Buffer }): Promise<ChunkCompletion> {
    const k = this.#keys;
    // Each run stages its results under its own name; the script keeps the first run's.
    const staged = k.batchStaged(id, chunk, randomBytes(6).toString('hex'));
    const result = await pipelined(
      this.#redis
        .pipeline()
        .set(staged, this.#sealer.seal('batch', sealId(id, owner), `out:${chunk}`, outcome.results), 'EX', this.#chunkTtl)
        .kfChunkComplete(k.batch(id), k.batchInput(id, chunk), k.batchResult(id, chunk), k.batchDone(id), k.backlogItems(), staged,
          chunk, outcome.count, outcome.succeeded, outcome.failed, this.#ttl, new Date().toISOString(), k.batchEvents(id), this.#openTtl, this.#chunkTtl, k.batch(id)),
    );
    if (result === -3) throw new Error(`chunk ${chunk}: its results were not stored before its completion (a refused or lost write); it runs again`);
    return COMPLETION[String(result)] ?? 'progress';
  }

  /** Ends a batch as failed (once); later chunk completions are ignored. */
  async fail(id: string, code: ErrorCode, message: string = CATALOGUE[code].message): Promise<boolean> {
    return this.#fail(id, code, message, '0');
  }

  async #fail(id: string, code: ErrorCode, message: string, onlyIf: '0' | 'unsealed' | 'abandoned'): Promise<boolean> {
    const k = this.#keys;
    return (await this.#redis.kfBatchFail(k.batch(id), k.backlogItems(), k.batchUpload(id), k.batchDone(id), code, message, new Date().toISOString(), k.batchEvents(id), onlyIf, k.batch(id), this.#ttl)) === 1;
  }

  /**
   * Cancels what has not run and deletes inputs and results; the status record stays
   * resultTtlSeconds from the batch's end. True when this cancelled it (it was queued or
   * running); false when it had ended already and only its data went.
   */
  async cancel(id: string): Promise<boolean> {
    const k = this.#keys;
    const result = await this.#redis.kfBatchCancel(k.batch(id), k.batchDone(id), k.backlogItems(), k.batchUpload(id), new Date().toISOString(), k.batchEvents(id), k.batch(id), this.#ttl);
    if (result === -1) throw new KeyfleetError('KF_BATCH_NOT_FOUND');
    return result === 1;
  }

  /**
   * A tenant's batches, newest first: `limit` of those made before the cursor `before` (the
   * `next` of the page before: a position in the index, which never goes stale). Ids whose record
   * expired are dropped from the index as they are met, so a page may hold fewer than `limit`
   * with more to follow.
   */
  async list(tenant: string, { before, limit }: { before?: number | undefined; limit: number }): Promise<{ batches: BatchRecord[]; next?: string }> {
    const index = this.#keys.batchIndex(tenant);
    const scored = await this.#redis.zrevrangebyscore(index, before === undefined ? '+inf' : `(${before}`, '-inf', 'WITHSCORES', 'LIMIT', 0, limit + 1);
    const ids: string[] = [];
    for (let i = 0; i < scored.length && ids.length < limit; i += 2) ids.push(scored[i]!);
    const records = await Promise.all(ids.map((id) => this.get(id)));
    const gone = ids.filter((_id, i) => records[i] === undefined);
    if (gone.length > 0) await this.#redis.zrem(index, ...gone);
    const batches = records.filter((record) => record !== undefined);
    // The score of the page's last id: unique, so the next page starts right after it.
    return scored.length > 2 * limit ? { batches, next: scored[2 * limit - 1]! } : { batches };
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
      chunkStarts: f['chunkStarts'] === '1',
      ...(f['callbackUrl'] ? { callbackUrl: f['callbackUrl'] } : {}),
      sealed: f['sealed'] === '1',
      deleted: f['deleted'] === '1',
      bound: f['bound'] === '1',
    };
  }
}

/** Which items each chunk of a batch holds. */
export interface ChunkLayout {
  /** The batch-wide index of the chunk's first item. */
  firstIndex(chunk: number): number;
  /** The chunk that holds item `index` (of the batch's items). */
  chunkOf(index: number): number;
}

/** Chunks of `chunkItems` items each but the last. */
class EvenChunks implements ChunkLayout {
  readonly #items: number;

  constructor(chunkItems: number) {
    this.#items = Math.max(chunkItems, 1);
  }

  firstIndex(chunk: number): number {
    return chunk * this.#items;
  }

  chunkOf(index: number): number {
    return Math.floor(index / this.#items);
  }
}

/** Each chunk's first item as stored (`RedisKeys.batchStarts`: a big-endian u32 per chunk). */
class StoredChunkStarts implements ChunkLayout {
  readonly #raw: Buffer;
  readonly #chunks: number;

  constructor(raw: Buffer, chunks: number) {
    this.#raw = raw;
    this.#chunks = chunks;
  }

  firstIndex(chunk: number): number {
    return this.#raw.readUInt32BE(chunk * 4);
  }

  /** The last chunk whose first item is at or before `index`. */
  chunkOf(index: number): number {
    let low = 0;
    let high = this.#chunks - 1;
    while (low < high) {
      const middle = (low + high + 1) >> 1;
      if (this.firstIndex(middle) <= index) low = middle;
      else high = middle - 1;
    }
    return low;
  }
}

/** The public view of a batch: what GET /v1/batches/{id} answers. */
export function publicStatus(record: BatchRecord): BatchStatusBody {
  // Named one by one: a field the record gains stays out of every answer, event and webhook.
  const { id, op, key, status, total, processed, succeeded, failed, createdAt, finishedAt, error, deleted } = record;
  return {
    id, op, key, status, total, processed, succeeded, failed, createdAt,
    ...(finishedAt !== undefined ? { finishedAt } : {}),
    ...(error !== undefined ? { error } : {}),
    ...(deleted ? { resultsDeleted: true as const } : {}),
  };
}

/** A GET whose reply, a Buffer or null, comes in a Handover (ioredis resolves the command's promise with it). */
class HandedOverGet extends Command {
  constructor(key: string) {
    super('get', [key]);
  }

  override transformReply(reply: Buffer | Buffer[]): never {
    return new Handover(reply) as never;
  }
}

/** Runs a pipeline of a payload write and a script; the script's answer, or the first error. */
async function pipelined(pipeline: ChainableCommander): Promise<unknown> {
  const results = (await pipeline.exec()) ?? [];
  for (const [err] of results) if (err) throw err;
  return results.at(-1)?.[1];
}
