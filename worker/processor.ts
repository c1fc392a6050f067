import { UnrecoverableError, type Job } from 'bullmq';
import { jobOwner, type BatchStore, type ChunkCompletion } from '../shared/batch-store.js';
import type { ChunkJob } from '../shared/crypto/chunk-kernel.js';
import { KeyfleetError } from '../shared/errors.js';
import type { KeyRing } from '../shared/crypto/key-ring.js';
import type { KeyCache } from '../shared/key-cache.js';
import type { KeyPolicy } from '../shared/key-policy.js';
import type { Logger } from '../shared/logger.js';
import type { WorkerMetrics } from '../shared/metrics.js';
import { resultLines, type NativeFormatter } from '../shared/result-codec.js';
import { chunkJobData, type ChunkJobData } from '../shared/schemas.js';
import type { CryptoPool } from './pool.js';

export interface ProcessorDeps {
  readonly batches: BatchStore;
  readonly keyCache: KeyCache;
  readonly keyPolicy: KeyPolicy;
  readonly pool: CryptoPool;
  readonly logger: Logger;
  readonly maxItemBytes: number;
  readonly metrics: WorkerMetrics;
  /** The native result formatter where the kernel is native (lines for jobs of an earlier API). */
  readonly formatter: NativeFormatter | undefined;
  /**
   * Called when this chunk's completion ended its batch (its webhook goes out); awaited, so the
   * job completes only once the delivery is enqueued, and fails (to run again, and announce the
   * end again) if that failed: a job completed without it would leave no rerun to announce it.
   */
  readonly onBatchEnded?: (batchId: string) => Promise<void> | void;
}

type ChunkOutcome = Awaited<ReturnType<CryptoPool['run']>>;

export interface ChunkReport {
  readonly chunk: number;
  readonly count: number;
  readonly completion: ChunkCompletion;
}

/**
 * The BullMQ processor of one chunk: read its packed inputs, run them in a thread, and account
 * the result in one script. Running the same chunk twice (crash, retry, stall) is harmless: the
 * script counts a chunk once, and a chunk already counted has had its inputs removed.
 */
export function createChunkProcessor({ batches, keyCache, keyPolicy, pool, logger, maxItemBytes, metrics, formatter, onBatchEnded }: ProcessorDeps) {
  return async (job: Job<ChunkJobData>): Promise<ChunkReport> => {
    const parsed = chunkJobData.safeParse(job.data);
    if (!parsed.success) throw new UnrecoverableError(`invalid chunk job: ${parsed.error.issues.map((i) => i.path.join('.') + ' ' + i.message).join('; ')}`);
    const data = parsed.data;
    const log = logger.child({ batchId: data.batchId, chunk: data.chunk, jobId: job.id, ...(data.requestId ? { requestId: data.requestId } : {}) });
    const stopTimer = metrics.chunkDuration.startTimer({ op: data.op });

    const input = await batches.startChunk(data.batchId, data.chunk, data.count, data);
    // Its batch fails for it (the failed handler): the batch the job names, which is the one
    // whose record it was held against.
    if (input === 'job-mismatch') throw new UnrecoverableError('the chunk job does not match its batch (tenant, op, key, encoding, context, target key or sealing): it was not run');
    if (!Buffer.isBuffer(input)) {
      // Counted already (a rerun), the batch cancelled or failed, or gone (expired or deleted
      // under this job: startChunk took its items out of the backlog), or its input expired.
      metrics.chunks.inc({ outcome: input === 'duplicate' ? 'duplicate' : 'skipped' });
      if (input === 'input-lost') {
        metrics.batches.inc({ event: 'failed' });
        log.warn('chunk input expired before it ran; batch failed');
        // A rerun would find the batch ended and announce nothing: a refused enqueue is only logged.
        await Promise.resolve(onBatchEnded?.(data.batchId)).catch((err: Error) => log.warn({ err: { message: err.message } }, 'webhook not delivered'));
      } else {
        log.debug({ completion: input }, 'nothing to run for this chunk');
        // Counted already, maybe by a run that completed the batch and never heard so (the
        // worker died after the script): announced again; the webhook still goes out once.
        if (input === 'duplicate') await onBatchEnded?.(data.batchId);
      }
      return { chunk: data.chunk, count: 0, completion: input };
    }

    // '' stands beside a sealed context only (see chunkJobData): never a context of its own.
    // Whose the batch's data is sealed for: the job's tenant is its batch's (startChunk held it).
    const owner = jobOwner(data);
    const context = data.sealedContext === undefined ? data.context || undefined : openContext(batches, data.batchId, owner, data.sealedContext);
    const spec: ChunkJob = { op: data.op, encoding: data.encoding, maxItemBytes, ...(context !== undefined ? { context } : {}) };
    // Encrypt and same-key rewrap seal under the key's latest version (rotated first when due);
    // a rewrap with targetKey opens with the source key and seals under the target's.
    let ring = data.op === 'decrypt' || data.targetKey ? await ringFor(keyCache, data) : await sealingRing(keyPolicy, data, data.key);
    const target = data.targetKey ? await sealingRing(keyPolicy, data, data.targetKey) : undefined;
    // Every run's encryptions count against the nonce budget, whether or not its results are
    // the ones kept: counted before the completion, a run whose completion reply is lost
    // (and reads as a duplicate when sent again) is not missed.
    const run = async (packed: Buffer): Promise<ChunkOutcome> => {
      const made = await pool.run(spec, packed, ring.toData(), target?.toData());
      if (data.op !== 'decrypt') keyPolicy.counted(data.tenant, target ?? ring, made.succeeded);
      return made;
    };
    let outcome = await run(input);
    if (outcome.newerVersionSeen) {
      // Some ciphertexts name a version newer than the cached ring: reload and run the chunk again.
      const fresh = await ringFor(keyCache, data, true);
      if (fresh.latestVersion > ring.latestVersion) {
        ring = fresh;
        const again = await batches.readInput(data.batchId, owner, data.chunk);
        if (again) outcome = await run(again);
      }
    }
    if (outcome.count !== data.count) {
      throw new UnrecoverableError(`chunk holds ${outcome.count} items, the job says ${data.count}`);
    }

    // An earlier API streams stored results as they are: give its jobs the lines themselves.
    const results = data.resultFormat === 'records' ? outcome.results : Buffer.concat([...resultLines(outcome.results, data.firstIndex, 0, formatter)]);
    const completion = await batches.completeChunk(data.batchId, owner, data.chunk, { ...outcome, results });
    stopTimer();
    if (completion === 'progress' || completion === 'completed') {
      metrics.chunks.inc({ outcome: 'counted' });
      metrics.countItems(data.op, ring.type, outcome.succeeded, outcome.failed);
    } else {
      metrics.chunks.inc({ outcome: completion === 'duplicate' ? 'duplicate' : 'skipped' });
    }
    if (completion === 'completed') {
      metrics.batches.inc({ event: 'completed' });
      log.info({ op: data.op }, 'batch completed');
      await onBatchEnded?.(data.batchId);
    } else if (completion === 'duplicate') {
      log.info('chunk already counted; this run discarded');
      // Maybe by this job's own run, whose reply was lost: announced again, as above.
      await onBatchEnded?.(data.batchId);
    }
    return { chunk: data.chunk, count: outcome.count, completion };
  };
}

function openContext(batches: BatchStore, batchId: string, owner: string | undefined, sealed: string): string {
  try {
    return batches.openContext(batchId, owner, sealed);
  } catch {
    // Not sealed for this batch under a master key this worker holds: no retry will open it.
    throw new UnrecoverableError('the batch context could not be opened');
  }
}

async function sealingRing(keyPolicy: KeyPolicy, data: ChunkJobData, key: string): Promise<KeyRing> {
  try {
    return await keyPolicy.forEncryption(data.tenant, key, { count: data.count });
  } catch (err) {
    // A key gone, or one that cannot encrypt (legacy, nonce budget spent): no retry will help.
    if (err instanceof KeyfleetError && err.status < 500) throw new UnrecoverableError(`key ${key}: ${err.code} ${err.message}`);
    throw err;
  }
}

async function ringFor(keyCache: KeyCache, data: ChunkJobData, fresh = false) {
  try {
    return await keyCache.get(data.tenant, data.key, { fresh });
  } catch (err) {
    if (err instanceof KeyfleetError && err.code === 'KF_KEY_NOT_FOUND') throw new UnrecoverableError(`key ${data.key} does not exist`);
    throw err;
  }
}
