import { Cluster, Redis as SingleRedis, type ClusterNode, type RedisOptions } from 'ioredis';
import { commandName, type Logger } from './logger.js';

/** A Redis connection: one server, or a Redis Cluster. Every script keeps its keys in one slot, so both work alike. */
export type Redis = SingleRedis | Cluster;

export interface RedisTarget {
  /** One redis:// URL, or for a cluster a comma-separated list of seed node URLs. */
  readonly redisUrl: string;
  readonly redisCluster: boolean;
}

export interface RedisRole {
  /** BullMQ workers need blocking commands retried forever (`maxRetriesPerRequest: null`). */
  readonly role: 'api' | 'worker' | 'subscriber' | 'tool';
  /** Where the connection's errors are logged; null when the caller listens for them itself. */
  readonly errors: ConnectionErrorLog | null;
}

/** Distinct messages remembered at once; past it, the one written longest ago is forgotten. */
const MAX_DISTINCT_ERRORS = 1_000;

/**
 * Logs the errors that repeat while Redis is unreachable. Every connection retries every 0.2–2 s
 * and BullMQ reports each failed attempt again; without this, each attempt was a line, and
 * where nothing listened, ioredis and BullMQ printed its stack to stderr. One structured line
 * per distinct message per `intervalMs` (with how many were held back), and one when a
 * connection is ready again.
 */
export class ConnectionErrorLog {
  readonly #logger: Logger;
  readonly #intervalMs: number;
  readonly #seen = new Map<string, { at: number; held: number }>();

  constructor(logger: Logger, intervalMs = 30_000) {
    this.#logger = logger;
    this.#intervalMs = intervalMs;
  }

  /** Writes `msg` with the error (and `fields`), unless the same message was written within the interval. */
  report(source: string, err: Error, msg: string, fields: Record<string, unknown> = {}): void {
    const now = Date.now();
    const seen = this.#seen.get(err.message);
    if (seen && now - seen.at < this.#intervalMs) {
      seen.held++;
      return;
    }
    // Kept in the order last written: past the bound, the longest quiet goes first.
    this.#seen.delete(err.message);
    if (this.#seen.size >= MAX_DISTINCT_ERRORS) this.#seen.delete(this.#seen.keys().next().value!);
    this.#seen.set(err.message, { at: now, held: 0 });
    const code = (err as NodeJS.ErrnoException).code;
    // A command Redis refused (a full Redis) by its name: never its arguments.
    const command = commandName(err);
    const shown = { message: err.message, ...(code ? { code } : {}), ...(command ? { command } : {}) };
    this.#logger.error({ ...fields, source, err: shown, ...(seen?.held ? { heldBack: seen.held } : {}) }, msg);
  }

  /** A connection is ready: after errors, says so with how many were held back, and the next error logs at once. */
  ready(source: string): void {
    if (this.#seen.size === 0) return;
    let heldBack = 0;
    for (const { held } of this.#seen.values()) heldBack += held;
    this.#seen.clear();
    this.#logger.info({ source, heldBack }, 'redis connection ready again');
  }
}

/**
 * How long the API waits for any one Redis reply. A Redis that keeps the connection but stops
 * answering (paused, a partition without resets) would otherwise hold every request for ever;
 * healthy replies, even a chunk's pipelined writes, come back in milliseconds.
 */
const API_COMMAND_TIMEOUT_MS = 2_000;

/** One place that turns the configuration into a client, single server or cluster alike. */
export function createRedis(target: RedisTarget, { role, errors }: RedisRole): Redis {
  const client = connect(target, role);
  // Always a listener: without one, ioredis prints every failed reconnect to stderr.
  client.on('error', (err: Error) => errors?.report(role, err, 'redis connection error'));
  client.on('ready', () => errors?.ready(role));
  return client;
}

/**
 * Logs an error whenever a connection of `client` becomes ready on a Redis that may evict keys
 * (a `maxmemory-policy` other than noeviction): an evicted wrapped key loses every ciphertext
 * under it, an evicted chunk its batch. At each connection, so a policy changed while keyfleet
 * runs shows at the next reconnect. A Redis that refuses INFO (some managed ones) goes unchecked.
 */
export function watchEvictionPolicy(client: Redis, logger: Logger): void {
  client.on('ready', () => {
    const nodes = 'nodes' in client ? client.nodes('master') : [client];
    for (const node of nodes) {
      node.info('memory').then(
        (info) => {
          const policy = /^maxmemory_policy:(\S+)/m.exec(info)?.[1];
          if (policy && policy !== 'noeviction') {
            logger.error({ maxmemoryPolicy: policy, redis: `${node.options.host}:${node.options.port}` }, 'redis may evict keys: keyfleet needs maxmemory-policy noeviction (an evicted wrapped key loses every ciphertext under it); CONFIG SET maxmemory-policy noeviction');
          }
        },
        () => {},
      );
    }
  });
}

function connect(target: RedisTarget, role: RedisRole['role']): Redis {
  // The API and tools fail a command fast when Redis is gone (the API answers 503) instead of
  // queueing it for ever; workers wait for Redis to come back.
  const failFast = role === 'api' || role === 'tool';
  const options: RedisOptions = {
    connectionName: `keyfleet-${role}`,
    // ioredis 6 speaks RESP3 unless told otherwise. keyfleet needs nothing RESP3 adds, and RESP2
    // keeps the replies of its scripts and of BullMQ's, and pub/sub, what they have always been.
    protocol: 2,
    maxRetriesPerRequest: failFast ? 2 : null,
    ...(failFast ? { commandTimeout: API_COMMAND_TIMEOUT_MS } : {}),
    retryStrategy: (attempt) => Math.min(attempt * 200, 2_000),
  };
  const urls = target.redisUrl.split(',').map((u) => u.trim()).filter(Boolean);
  if (!target.redisCluster) return new SingleRedis(urls[0]!, { ...options, enableAutoPipelining: role === 'api' });

  const seeds: ClusterNode[] = urls.map((u) => {
    const url = new URL(u);
    return { host: url.hostname, port: Number(url.port || 6379) };
  });
  const first = new URL(urls[0]!);
  return new Cluster(seeds, {
    enableAutoPipelining: role === 'api',
    clusterRetryStrategy: (attempt) => Math.min(attempt * 200, 2_000),
    redisOptions: {
      ...options,
      ...(first.username ? { username: decodeURIComponent(first.username) } : {}),
      ...(first.password ? { password: decodeURIComponent(first.password) } : {}),
      ...(first.protocol === 'rediss:' ? { tls: {} } : {}),
    },
  });
}

/** The Redis key layout. Everything lives under one `{hash tag}` prefix, so multi-key scripts stay in one slot. */
export class RedisKeys {
  readonly prefix: string;
  /** The BullMQ queue of chunks; BullMQ puts its own keys under `${prefix}:chunks:*`. */
  readonly queueName = 'chunks';
  /** The BullMQ queue of webhook deliveries (one job per batch), under `${prefix}:webhooks:*`: the same slot. */
  readonly webhookQueueName = 'webhooks';

  constructor(prefix: string) {
    this.prefix = prefix;
  }

  key(tenant: string, name: string): string {
    return `${this.prefix}:key:${tenant}:${name}`;
  }

  /** A tenant's key names (a sorted set, every score 0: listed in name order). */
  keyIndex(tenant: string): string {
    return `${this.prefix}:key-index:${tenant}`;
  }

  /** The tenant and name of a key's Redis name (`key()`); undefined for any other name. */
  keyOf(redisKey: string): { tenant: string; name: string } | undefined {
    const head = `${this.prefix}:key:`;
    // Tenants and key names hold no colon (tokens.ts, KEY_NAME).
    const [tenant, name, ...rest] = redisKey.startsWith(head) ? redisKey.slice(head.length).split(':') : [];
    return tenant && name && rest.length === 0 ? { tenant, name } : undefined;
  }

  /** The channel on which the key store's scripts publish the Redis name of a key they changed. */
  get keyChanges(): string {
    return `${this.prefix}:key-changes`;
  }

  batch(id: string): string {
    return `${this.prefix}:batch:${id}`;
  }

  /** A chunk's packed inputs (sealed). The cancel and fail scripts build this name from batch(id). */
  batchInput(id: string, chunk: number): string {
    return `${this.batch(id)}:in:${chunk}`;
  }

  /** A chunk's results (sealed records, shared/result-codec.ts). The cancel script builds this name from batch(id). */
  batchResult(id: string, chunk: number): string {
    return `${this.batch(id)}:out:${chunk}`;
  }

  /** One run's results, written before the completion script keeps or drops them. */
  batchStaged(id: string, chunk: number, run: string): string {
    return `${this.prefix}:batch:${id}:out:${chunk}:${run}`;
  }

  /**
   * Bitmap of chunks stored by the upload: the guard that makes adding a chunk idempotent (a
   * client that lost the reply sends the script again). Deleted when the upload is sealed.
   */
  batchAdded(id: string): string {
    return `${this.batch(id)}:added`;
  }

  /**
   * Where each chunk starts: the batch-wide index of its first item, a big-endian u32 per chunk.
   * Chunks close at CHUNK_ITEMS items or CHUNK_BYTES bytes, so a download cannot work it out from
   * the chunk's number. Lives as long as the results.
   */
  batchStarts(id: string): string {
    return `${this.batch(id)}:starts`;
  }

  /** Bitmap of chunks already accounted: the guard that makes a chunk's completion idempotent. */
  batchDone(id: string): string {
    return `${this.prefix}:batch:${id}:done`;
  }

  /** Items stored but not yet processed, over all batches: the backlog that scaling and backpressure watch. */
  backlogItems(): string {
    return `${this.prefix}:backlog-items`;
  }

  /** Exists while an upload into the batch is alive; an unsealed batch without it was abandoned. */
  batchUpload(id: string): string {
    return `${this.prefix}:batch:${id}:upload`;
  }

  /** Set of a tenant's batch ids that may still be queued or running (admission counts them). */
  tenantBatches(tenant: string): string {
    return `${this.prefix}:tenant:${tenant}:batches`;
  }

  /** A tenant's batch ids in order of creation (scored by its ms, unique: batch-scripts.ts CREATE), for listing: the newest BATCH_INDEX_MAX. */
  batchIndex(tenant: string): string {
    return `${this.prefix}:tenant:${tenant}:batch-index`;
  }

  /** An Idempotency-Key record, named by a hash of tenant and key. */
  idempotency(id: string): string {
    return `${this.prefix}:idem:${id}`;
  }

  batchEvents(id: string): string {
    return `${this.prefix}:batch-events:${id}`;
  }
}
