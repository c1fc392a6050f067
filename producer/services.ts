import type { Queue } from 'bullmq';
import type { Registry } from 'prom-client';
import { AtRestSealer } from '../shared/at-rest.js';
import { BatchStore } from '../shared/batch-store.js';
import { requireMasterKey, type Config } from '../shared/config.js';
import { KeyCache } from '../shared/key-cache.js';
import { KeyChanges } from '../shared/key-changes.js';
import { KeyPolicy } from '../shared/key-policy.js';
import { KeyStore } from '../shared/key-store.js';
import { MasterKey } from '../shared/master-key.js';
import { ApiMetrics, createRegistry } from '../shared/metrics.js';
import { createChunkQueue, createWebhookQueue, type WebhookJobData } from '../shared/queue.js';
import type { Logger } from '../shared/logger.js';
import { ConnectionErrorLog, createRedis, RedisKeys, watchEvictionPolicy, type Redis } from '../shared/redis.js';
import { WebhookSender } from '../shared/webhooks.js';
import type { ChunkJobData } from '../shared/schemas.js';
import { BatchEvents } from './batch-events.js';
import { IdempotencyStore, pendingMs } from './idempotency.js';
import { registerQueueMetrics } from './queue-metrics.js';

/** The long-lived parts the API's routes share; `close()` releases every connection. */
export interface ApiServices {
  readonly redis: Redis;
  readonly keyStore: KeyStore;
  readonly keyCache: KeyCache;
  readonly keyPolicy: KeyPolicy;
  readonly batches: BatchStore;
  readonly idempotency: IdempotencyStore;
  readonly queue: Queue<ChunkJobData>;
  /** Webhook deliveries (the API only adds them; workers send them). */
  readonly webhookQueue: Queue<WebhookJobData>;
  readonly events: BatchEvents;
  readonly registry: Registry;
  readonly metrics: ApiMetrics;
  readonly webhooks: WebhookSender;
  /** Where this process's Redis errors are logged, each message once per interval. */
  readonly connectionErrors: ConnectionErrorLog;
  close(): Promise<void>;
}

/** A batch just failed as an abandoned upload: counted, and its webhook (if it asked for one) sent. */
export function announceAbandoned({ batches, metrics, webhooks }: Pick<ApiServices, 'batches' | 'metrics' | 'webhooks'>, id: string): void {
  metrics.batches.inc({ event: 'failed' });
  webhooks.deliver(batches, id);
}

/**
 * Fails the uploads whose API died (or whose client stopped sending, with its API gone) as soon
 * as their lease lapses, not when someone next reads the batch: until then each held its items
 * in the backlog gauge (and so in autoscaling and the backlog alerts), a slot of the tenant's
 * MAX_ACTIVE_BATCHES, and its failure webhook. Every `abandonSweepMs` (at most 10 s), over the
 * tenants of KEYFLEET_TOKENS; every API sweeps, and each batch fails once.
 */
function sweepAbandonedUploads(batches: BatchStore, tenants: readonly string[], failed: (id: string) => void, errors: ConnectionErrorLog): { stop(): void } {
  let running = false;
  const timer = setInterval(() => {
    if (running) return;
    running = true;
    void Promise.all(tenants.map(async (tenant) => (await batches.failAbandoned(tenant)).forEach(failed)))
      .catch((err: Error) => errors.report('upload-sweep', err, 'abandoned-upload sweep failed'))
      .finally(() => (running = false));
  }, batches.abandonSweepMs).unref();
  return { stop: () => clearInterval(timer) };
}

export function createApiServices(config: Config, logger: Logger): ApiServices {
  // Before any connection is opened: without a master key the API fails with nothing to close.
  const masterKey = requireMasterKey(config);
  const errors = new ConnectionErrorLog(logger);
  const redis = createRedis(config, { role: 'api', errors });
  watchEvictionPolicy(redis, logger);
  const keys = new RedisKeys(config.prefix);
  const keyStore = new KeyStore(redis, keys, new MasterKey(masterKey, config.previousMasterKey));
  const sealer = new AtRestSealer(masterKey, config.previousMasterKey);
  const queueRedis = createRedis(config, { role: 'api', errors });
  const queue = createChunkQueue(queueRedis, keys, { attempts: config.jobAttempts, errors });
  const events = new BatchEvents(createRedis(config, { role: 'subscriber', errors }), keys);
  const batches = new BatchStore(redis, keys, { resultTtlSeconds: config.resultTtlSeconds, uploadIdleSeconds: config.uploadIdleSeconds, sealer });
  const registry = createRegistry('api');
  registerQueueMetrics(registry, queue, batches);
  // The API only enqueues webhooks; worker processes send them.
  const webhookQueue = createWebhookQueue(queueRedis, keys, { keepSeconds: config.resultTtlSeconds, errors });
  const webhooks = new WebhookSender(webhookQueue, { secret: config.webhookSecret, allowedHosts: config.webhookAllowedHosts, logger });
  const keyCache = new KeyCache(keyStore, config.keyCacheTtlMs);
  const keyChanges = new KeyChanges(createRedis(config, { role: 'subscriber', errors }), keys, keyCache, errors);
  const metrics = new ApiMetrics(registry);
  const keyPolicy = new KeyPolicy(keyCache, { limit: config.nonceLimit, rotateShare: config.nonceRotateShare }, metrics, logger, errors);
  const tenants = [...new Set(config.tokens.map((entry) => entry.tenant))];
  const sweep = sweepAbandonedUploads(batches, tenants, (id) => announceAbandoned({ batches, metrics, webhooks }, id), errors);
  return {
    redis,
    keyStore,
    keyCache,
    keyPolicy,
    batches,
    idempotency: new IdempotencyStore(redis, keys, sealer, config.idempotencyTtlSeconds, pendingMs(config.uploadIdleSeconds)),
    queue,
    webhookQueue,
    events,
    registry,
    metrics,
    webhooks,
    connectionErrors: errors,
    async close() {
      sweep.stop();
      keyChanges.close();
      await Promise.allSettled([queue.close(), events.close(), webhooks.close(), keyPolicy.close()]);
      await Promise.allSettled([redis.quit(), queueRedis.quit()]);
    },
  };
}
