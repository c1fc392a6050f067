import { UnrecoverableError, Worker } from 'bullmq';
import type { Registry } from 'prom-client';
import { AtRestSealer } from '../shared/at-rest.js';
import { BatchStore } from '../shared/batch-store.js';
import { requireMasterKey, type Config } from '../shared/config.js';
import { KeyCache } from '../shared/key-cache.js';
import { KeyChanges } from '../shared/key-changes.js';
import { KeyPolicy } from '../shared/key-policy.js';
import { KeyStore } from '../shared/key-store.js';
import type { Logger } from '../shared/logger.js';
import { MasterKey } from '../shared/master-key.js';
import { createRegistry, WorkerMetrics } from '../shared/metrics.js';
import { resolveKernel, resultFormatter } from '../shared/crypto/kernel.js';
import { createWebhookQueue, parseChunkJobId } from '../shared/queue.js';
import { ConnectionErrorLog, createRedis, RedisKeys, watchEvictionPolicy } from '../shared/redis.js';
import { cannotListen, startFacts } from '../shared/startup.js';
import type { ChunkJobData } from '../shared/schemas.js';
import { WebhookSender } from '../shared/webhooks.js';
import { startWorkerHttp } from './http-server.js';
import { CryptoPool } from './pool.js';
import { createChunkProcessor, type ChunkReport } from './processor.js';
import { startWebhookWorker } from './webhook-delivery.js';

export interface RunningWorker {
  /** The port of the worker's /metrics, /healthz, /readyz server. */
  readonly metricsPort: number;
  /** Stops taking chunks, finishes the ones in hand, then closes the pool and connections. */
  close(): Promise<void>;
}

/** Starts a worker: a BullMQ Worker on the chunk queue feeding a thread pool, plus its metrics server. */
export async function startWorker(config: Config, logger: Logger): Promise<RunningWorker> {
  // Before anything is opened: a worker that cannot run fails without a connection or thread to close.
  const masterKey = requireMasterKey(config);
  resolveKernel(config.kernel); // fails here where `native` was asked for and is not built
  const errors = new ConnectionErrorLog(logger);
  const redis = createRedis(config, { role: 'worker', errors });
  watchEvictionPolicy(redis, logger);
  const keys = new RedisKeys(config.prefix);
  const registry = createRegistry('worker');
  // Ready from "worker started" until close(). A connection that is not up answers at once: the
  // client would queue the PING until Redis is back.
  let taking = false;
  const ready = async (): Promise<boolean> => taking && redis.status === 'ready' && (await redis.ping()) === 'PONG';
  // Bound before the pool starts and the queue is read: a worker that cannot have its port
  // (another worker on this host holds it) stops before it takes a chunk, not with chunks in hand.
  const http = await listenForProbes(config, registry, ready).catch((err: unknown) => {
    redis.disconnect();
    throw err;
  });
  const batches = new BatchStore(redis, keys, { resultTtlSeconds: config.resultTtlSeconds, uploadIdleSeconds: config.uploadIdleSeconds, sealer: new AtRestSealer(masterKey, config.previousMasterKey) });
  const keyCache = new KeyCache(new KeyStore(redis, keys, new MasterKey(masterKey, config.previousMasterKey)), config.keyCacheTtlMs);
  const keyChanges = new KeyChanges(createRedis(config, { role: 'subscriber', errors }), keys, keyCache, errors);
  const pool = new CryptoPool({ threads: config.workerThreads, kernel: config.kernel, priority: config.workerPriority });
  const metrics = new WorkerMetrics(registry, pool);
  const keyPolicy = new KeyPolicy(keyCache, { limit: config.nonceLimit, rotateShare: config.nonceRotateShare }, metrics, logger, errors);
  const webhookOptions = { secret: config.webhookSecret, allowedHosts: config.webhookAllowedHosts, logger };
  const webhooks = new WebhookSender(createWebhookQueue(redis, keys, { keepSeconds: config.resultTtlSeconds, errors }), webhookOptions);
  // Sends the queued webhooks (from any process); without a secret there is nothing to sign, so none are queued.
  const webhookWorker = config.webhookSecret
    ? startWebhookWorker({ ...webhookOptions, connection: createRedis(config, { role: 'worker', errors }), keys, batches, errors })
    : undefined;

  const worker = new Worker<ChunkJobData, ChunkReport>(
    keys.queueName,
    createChunkProcessor({
      batches, keyCache, keyPolicy, pool, logger, maxItemBytes: config.maxItemBytes, metrics,
      formatter: resultFormatter(config.kernel),
      // Awaited, and failing the job when Redis refuses it: the job's rerun announces the end again.
      onBatchEnded: (id) => webhooks.enqueue(batches, id),
    }),
    {
      connection: createRedis(config, { role: 'worker', errors }),
      prefix: keys.prefix,
      concurrency: config.workerConcurrency,
      // A chunk takes milliseconds; the lock only matters when a worker dies holding one.
      lockDuration: config.jobLockMs,
      stalledInterval: config.jobLockMs,
      maxStalledCount: 3,
    },
  );

  // Batches being failed by their last chunk: close() waits for them, so their webhooks are queued.
  const failing = new Set<Promise<void>>();
  worker.on('failed', (job, err) => {
    if (!job) return;
    const { batchId, chunk, requestId } = job.data;
    const final = err instanceof UnrecoverableError || err.name === 'UnrecoverableError' || job.attemptsMade >= (job.opts.attempts ?? 1);
    metrics.chunks.inc({ outcome: 'failed' });
    logger.warn({ batchId, chunk, requestId, jobId: job.id, attempts: job.attemptsMade, final, err: { message: err.message } }, 'chunk failed');
    if (final) {
      const marking = batches.fail(batchId, 'KF_CHUNK_FAILED', `chunk ${chunk} failed after ${job.attemptsMade} attempt(s): ${err.message}`).then(
        (changed) => {
          if (!changed) return;
          metrics.batches.inc({ event: 'failed' });
          logger.warn({ batchId, requestId }, 'batch failed');
          webhooks.deliver(batches, batchId);
        },
        (e: unknown) => logger.error({ err: e, batchId }, 'could not mark batch failed'),
      );
      failing.add(marking);
      void marking.finally(() => failing.delete(marking));
    }
  });
  worker.on('error', (err) => errors.report('worker', err, 'worker error'));
  // BullMQ's stalled-job check found a chunk whose lock lapsed (its worker died or hung) and put it
  // back in the queue; this worker or another takes it from there.
  worker.on('stalled', (jobId) => {
    const { batchId, chunk } = parseChunkJobId(jobId);
    logger.warn({ jobId, ...(batchId ? { batchId, chunk } : {}) }, 'chunk retaken: the worker that held it stopped renewing its lock (it died or hung); it runs again');
  });

  taking = true;
  logger.info(
    { ...startFacts(config), queue: `${keys.prefix}:${keys.queueName}`, threads: pool.threads, concurrency: config.workerConcurrency, metricsPort: http.port },
    'worker started',
  );

  return {
    metricsPort: http.port,
    async close() {
      taking = false;
      await worker.close();
      await Promise.allSettled([...failing]);
      // After the chunks: a chunk that ended its batch has enqueued its webhook by now. A delivery
      // in flight finishes; its retries wait in Redis for another worker.
      await Promise.all([pool.close(), webhooks.close(), webhookWorker?.close(), keyPolicy.close()]);
      const closed = new Promise<void>((done) => http.server.close(() => done()));
      http.server.closeAllConnections();
      await closed;
      keyChanges.close();
      await Promise.allSettled([redis.quit(), worker.disconnect()]);
    },
  };
}

/**
 * The worker's /metrics, /healthz, /readyz server on HOST:WORKER_METRICS_PORT. A port already
 * taken is most often a second worker on the same host: the error says which setting to change.
 */
async function listenForProbes(config: Config, registry: Registry, ready: () => Promise<boolean>) {
  try {
    return await startWorkerHttp({ host: config.host, port: config.workerMetricsPort, registry, ready });
  } catch (err) {
    throw cannotListen('WORKER_METRICS_PORT', config.host, config.workerMetricsPort, err, 'each worker process on one host needs its own WORKER_METRICS_PORT, or 0 for a free one');
  }
}
