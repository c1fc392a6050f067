import { Queue, type JobsOptions } from 'bullmq';
import type { ConnectionErrorLog, Redis, RedisKeys } from './redis.js';
import type { ChunkJobData } from './schemas.js';

export const CHUNK_JOB = 'chunk';

export interface ChunkQueueOptions {
  /** Tries per chunk before its batch is failed; retried chunks are idempotent. */
  readonly attempts: number;
  readonly errors: ConnectionErrorLog;
}

/** BullMQ job ids may not contain ':'; batch ids are base64url, so '.' separates safely. */
export const chunkJobId = (batchId: string, chunk: number): string => `${batchId}.${chunk}`;
/** A chunk job's batch and chunk, chunkJobId read back (batch ids hold no dot); neither for another id. */
export function parseChunkJobId(jobId: string): { batchId?: string; chunk?: number } {
  const dot = jobId.lastIndexOf('.');
  const chunk = jobId.slice(dot + 1);
  return dot > 0 && /^\d+$/.test(chunk) ? { batchId: jobId.slice(0, dot), chunk: Number(chunk) } : {};
}

export function createChunkQueue(connection: Redis, keys: RedisKeys, { attempts, errors }: ChunkQueueOptions): Queue<ChunkJobData> {
  const defaultJobOptions: JobsOptions = {
    attempts,
    backoff: { type: 'exponential', delay: 500 },
    // Jobs are references to Redis-held chunks: keep a window of history for Bull Board, not all of it.
    removeOnComplete: { age: 3600, count: 5000 },
    removeOnFail: { age: 7 * 86_400 },
  };
  return logged(new Queue<ChunkJobData>(keys.queueName, { connection, prefix: keys.prefix, defaultJobOptions }), errors);
}

/**
 * A Queue passes on its connection's errors (and its own), and BullMQ prints them to stderr
 * where nothing listens: they go to the process's error log, which writes each message once
 * however many connections report it.
 */
function logged<T extends Queue>(queue: T, errors: ConnectionErrorLog): T {
  queue.on('error', (err) => errors.report('queue', err, 'queue error'));
  return queue;
}

export const WEBHOOK_JOB = 'webhook';

/** A webhook delivery job: the batch only; the status and callbackUrl are read from its record when sent. */
export interface WebhookJobData {
  readonly batchId: string;
}

/**
 * One delivery job per batch, whoever enqueues it: BullMQ ignores an add whose job id exists.
 * The suffix keeps the id from ever being all digits (BullMQ refuses integer-like custom ids).
 */
export const webhookJobId = (batchId: string): string => `${batchId}.webhook`;

export interface WebhookQueueOptions {
  /**
   * How long finished delivery jobs are kept (RESULT_TTL_SECONDS). The kept job id is what stops a
   * second delivery of the same batch (a rerun of a chunk counted already announces its batch's
   * end again), so it must outlive the batch record: bounded by age, not by count.
   */
  readonly keepSeconds: number;
  readonly errors: ConnectionErrorLog;
}

export function createWebhookQueue(connection: Redis, keys: RedisKeys, { keepSeconds, errors }: WebhookQueueOptions): Queue<WebhookJobData> {
  const defaultJobOptions: JobsOptions = {
    removeOnComplete: { age: keepSeconds },
    removeOnFail: { age: keepSeconds },
  };
  return logged(new Queue<WebhookJobData>(keys.webhookQueueName, { connection, prefix: keys.prefix, defaultJobOptions }), errors);
}
