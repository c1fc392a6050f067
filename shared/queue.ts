import { Queue, type JobsOptions } from 'bullmq';
import type { Redis, RedisKeys } from './redis.js';
import type { ChunkJobData } from './schemas.js';

export const CHUNK_JOB = 'chunk';

export interface ChunkQueueOptions {
  /** Tries per chunk before its batch is failed; retried chunks are idempotent. */
  readonly attempts: number;
}

/** BullMQ job ids may not contain ':'; batch ids are base64url, so '.' separates safely. */
export const chunkJobId = (batchId: string, chunk: number): string => `${batchId}.${chunk}`;

export function createChunkQueue(connection: Redis, keys: RedisKeys, { attempts }: ChunkQueueOptions): Queue<ChunkJobData> {
  const defaultJobOptions: JobsOptions = {
    attempts,
    backoff: { type: 'exponential', delay: 500 },
    // Jobs are references to Redis-held chunks: keep a window of history for Bull Board, not all of it.
    removeOnComplete: { age: 3600, count: 5000 },
    removeOnFail: { age: 7 * 86_400 },
  };
  return new Queue<ChunkJobData>(keys.queueName, { connection, prefix: keys.prefix, defaultJobOptions });
}
