import type { Queue } from 'bullmq';
import { Gauge, type Registry } from 'prom-client';
import type { BatchStore } from '../shared/batch-store.js';

const STATES = ['waiting', 'active', 'delayed', 'failed', 'prioritized', 'waiting-children'] as const;
const SCRAPE_TIMEOUT_MS = 2_000;

interface Snapshot {
  readonly counts: Record<string, number>;
  readonly backlogItems: number;
  readonly oldestWaitingSeconds: number;
  readonly workers: number;
}

/**
 * Queue-wide gauges, read from Redis when Prometheus scrapes the API (the one place that sees
 * the whole fleet's queue). prom-client collects metrics in parallel, so all of them await one
 * shared read per scrape. When Redis does not answer in time, `keyfleet_redis_up` is 0 and the
 * other gauges keep their last values.
 */
export function registerQueueMetrics(registry: Registry, queue: Queue, batches: BatchStore): void {
  let inflight: Promise<Snapshot | undefined> | undefined;
  const snapshot = (): Promise<Snapshot | undefined> => {
    inflight ??= read()
      .catch(() => undefined)
      .finally(() => setImmediate(() => (inflight = undefined)));
    const timeout = new Promise<undefined>((done) => setTimeout(() => done(undefined), SCRAPE_TIMEOUT_MS).unref());
    return Promise.race([inflight, timeout]);
  };
  const read = async (): Promise<Snapshot> => {
    const [counts, backlogItems, first, workers] = await Promise.all([
      queue.getJobCounts(...STATES),
      batches.backlogItems(),
      queue.getJobs(['wait'], 0, 0, true),
      queue.getWorkersCount(),
    ]);
    const oldest = first[0];
    return { counts, backlogItems, workers, oldestWaitingSeconds: oldest ? Math.max(0, (Date.now() - oldest.timestamp) / 1000) : 0 };
  };

  new Gauge({
    name: 'keyfleet_redis_up',
    help: '1 when Redis answered the last scrape, else 0.',
    registers: [registry],
    async collect() {
      this.set((await snapshot()) ? 1 : 0);
    },
  });
  new Gauge({
    name: 'keyfleet_queue_jobs',
    help: 'Chunk jobs in the queue by state.',
    labelNames: ['state'],
    registers: [registry],
    async collect() {
      const s = await snapshot();
      if (s) for (const state of STATES) this.set({ state }, s.counts[state] ?? 0);
    },
  });
  const fromSnapshot = (name: string, help: string, pick: (s: Snapshot) => number): void => {
    new Gauge({
      name,
      help,
      registers: [registry],
      async collect() {
        const s = await snapshot();
        if (s) this.set(pick(s));
      },
    });
  };
  fromSnapshot('keyfleet_queue_backlog_items', 'Items stored in chunks and not yet processed, over all batches.', (s) => s.backlogItems);
  fromSnapshot('keyfleet_queue_oldest_waiting_seconds', 'Age of the oldest chunk waiting for a worker (0 when none waits).', (s) => s.oldestWaitingSeconds);
  fromSnapshot('keyfleet_queue_workers', 'Worker connections the queue sees in Redis (one per live worker process).', (s) => s.workers);
}
