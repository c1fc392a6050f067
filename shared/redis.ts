import { Redis, type RedisOptions } from 'ioredis';

export type { Redis };

export interface RedisRole {
  /** BullMQ workers need blocking commands retried forever (`maxRetriesPerRequest: null`). */
  readonly role: 'api' | 'worker' | 'subscriber' | 'tool';
}

/**
 * One place that turns REDIS_URL into a client, so a later switch to Redis Cluster or TLS
 * settings touches this file only.
 */
export function createRedis(url: string, { role }: RedisRole): Redis {
  const options: RedisOptions = {
    connectionName: `keyfleet-${role}`,
    // The API fails a request fast when Redis is gone (503) instead of queueing it for ever.
    maxRetriesPerRequest: role === 'api' ? 2 : null,
    enableAutoPipelining: role === 'api',
    retryStrategy: (attempt) => Math.min(attempt * 200, 2_000),
  };
  return new Redis(url, options);
}

/** The Redis key layout. Everything lives under one `{hash tag}` prefix, so multi-key scripts stay in one slot. */
export class RedisKeys {
  readonly prefix: string;
  /** The BullMQ queue of chunks; BullMQ puts its own keys under `${prefix}:chunks:*`. */
  readonly queueName = 'chunks';

  constructor(prefix: string) {
    this.prefix = prefix;
  }

  key(tenant: string, name: string): string {
    return `${this.prefix}:key:${tenant}:${name}`;
  }

  batch(id: string): string {
    return `${this.prefix}:batch:${id}`;
  }

  /** Hash of chunk index → packed inputs. */
  batchInputs(id: string): string {
    return `${this.prefix}:batch:${id}:in`;
  }

  /** Hash of chunk index → NDJSON result lines. */
  batchResults(id: string): string {
    return `${this.prefix}:batch:${id}:out`;
  }

  /** Bitmap of chunks already accounted: the guard that makes a chunk's completion idempotent. */
  batchDone(id: string): string {
    return `${this.prefix}:batch:${id}:done`;
  }

  /** Items stored but not yet processed, over all batches: the backlog that scaling and backpressure watch. */
  backlogItems(): string {
    return `${this.prefix}:backlog-items`;
  }

  batchEvents(id: string): string {
    return `${this.prefix}:batch-events:${id}`;
  }
}
