import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import { KEY_TYPES, type KeyType } from './crypto/key-ring.js';
import { BATCH_OPS, type BatchOp } from './schemas.js';

/**
 * Prometheus metrics. Every label has a small, fixed set of values (ops, key types, outcomes,
 * route templates, states): no key name, tenant, batch id, token or item ever becomes a label.
 */
export const OUTCOMES = ['success', 'failure'] as const;
/** Why KeyPolicy rotated a key by itself. */
const ROTATION_REASONS = ['nonce_budget', 'period'] as const;
/** Batch events each process decides: the API sees uploads end, a worker sees processing end. */
const API_BATCH_EVENTS = ['created', 'cancelled', 'failed'] as const;
const WORKER_BATCH_EVENTS = ['completed', 'failed'] as const;
const CHUNK_OUTCOMES = ['counted', 'duplicate', 'skipped', 'failed'] as const;
const ROUTING_DECISIONS = ['sync', 'async'] as const;

export function createRegistry(component: 'api' | 'worker'): Registry {
  const registry = new Registry();
  registry.setDefaultLabels({ component });
  collectDefaultMetrics({ register: registry, prefix: 'keyfleet_' });
  // prom-client names three gauges `…_total`, a suffix only counters may carry (promtool says
  // so); the same totals are `sum without(type)` of keyfleet_nodejs_active_{handles,requests,resources}.
  for (const name of ['handles', 'requests', 'resources']) registry.removeSingleMetric(`keyfleet_nodejs_active_${name}_total`);
  return registry;
}

/**
 * A counter's increments gathered as plain numbers, and added to it when the registry is read
 * (prom-client calls a metric's `collect` first). An increment through prom-client validates and
 * hashes its labels every time, even through a bound child: the sync path's two increments were
 * 3.4% of the API's CPU time under the 10-item encrypt (a profile, bench/NOTES.md).
 */
class Tally<T extends string> {
  readonly #slots: Array<{ readonly labels: Partial<Record<T, string>>; n: number }> = [];

  /** A slot for one label set: `slot.n += k` is an increment. */
  slot(labels: Partial<Record<T, string>>): { n: number } {
    const slot = { labels, n: 0 };
    this.#slots.push(slot);
    return slot;
  }

  /** Adds what was gathered to `counter` (its `collect`). */
  addTo(counter: Counter<T>): void {
    for (const slot of this.#slots) {
      if (slot.n === 0) continue;
      counter.inc(slot.labels, slot.n);
      slot.n = 0;
    }
  }
}

/** Metrics both processes record: items through the crypto engine, and the keys' nonce budgets. */
export class CryptoMetrics {
  readonly items: Counter<'op' | 'key_type' | 'outcome' | 'path'>;
  /** The largest share of its nonce budget any random-nonce AES-GCM key version has used, as this process counted. */
  readonly nonceBudgetUsed: Gauge;
  readonly autoRotations: Counter<'reason'>;
  /** Items by op and key type: [succeeded, failed]. */
  readonly #items = new Map<string, Map<string, readonly [{ n: number }, { n: number }]>>();

  /** `path` is the only one this process counts items on: sync in the API, batch in a worker. */
  constructor(registry: Registry, path: 'sync' | 'batch') {
    this.nonceBudgetUsed = new Gauge({
      name: 'keyfleet_nonce_budget_max_used_ratio',
      help: 'Highest share of the nonce budget (NONCE_LIMIT encryptions) used by any random-nonce AES-GCM key version, 0..1; keys rotate at NONCE_ROTATE_SHARE.',
      registers: [registry],
    });
    this.autoRotations = new Counter({
      name: 'keyfleet_key_auto_rotations_total',
      help: 'Keys rotated automatically, by reason (nonce_budget, period).',
      labelNames: ['reason'],
      registers: [registry],
    });
    const items = new Tally<'op' | 'key_type' | 'outcome' | 'path'>();
    this.items = new Counter({
      name: 'keyfleet_items_processed_total',
      help: 'Items through the crypto engine, by operation, key type, outcome and path (sync in the API, batch in a worker).',
      labelNames: ['op', 'key_type', 'outcome', 'path'],
      registers: [registry],
      collect() {
        items.addTo(this);
      },
    });
    for (const op of BATCH_OPS) {
      const slots = (type: KeyType) => OUTCOMES.map((outcome) => items.slot({ op, key_type: type, outcome, path })) as [{ n: number }, { n: number }];
      this.#items.set(op, new Map(KEY_TYPES.map((type) => [type, slots(type)])));
    }
    zeroed(this.autoRotations, ROTATION_REASONS.map((reason) => ({ reason })));
    // Ops x key types x outcomes, 16 series (legacy keys never encrypt), so that the first failed
    // item of each counts in KeyfleetHighErrorRate.
    const kinds = BATCH_OPS.flatMap((op) => KEY_TYPES.filter((type) => op !== 'encrypt' || type !== 'legacy-aes256-cbc').map((type) => ({ op, key_type: type })));
    zeroed(this.items, kinds.flatMap((kind) => OUTCOMES.map((outcome) => ({ ...kind, outcome, path }))));
  }

  /** Items through the crypto engine, on this process's path. */
  countItems(op: BatchOp, keyType: KeyType, succeeded: number, failed: number): void {
    const [success, failure] = this.#items.get(op)!.get(keyType)!;
    success.n += succeeded;
    failure.n += failed;
  }
}

/**
 * The child of a metric for one label set, bound on first use. Label sets are few and fixed;
 * an unbound call makes prom-client build and validate the label object every time.
 */
function bound<T>(children: Map<string, T>, id: string, bind: () => T): T {
  let child = children.get(id);
  if (child === undefined) children.set(id, (child = bind()));
  return child;
}

/**
 * Exports every series of a labelled counter at 0 from the start. prom-client creates a series
 * at its first increment, and rate()/increase() need a sample before that one: a counter born
 * at 1 shows no increase, so the first failure after each (re)start would be invisible to the
 * dashboard and to the alerts. Only the fixed label values a process can count are listed.
 */
function zeroed<T extends string>(counter: Counter<T>, labelSets: ReadonlyArray<Partial<Record<T, string>>>): void {
  for (const labels of labelSets) counter.inc(labels, 0);
}

export class ApiMetrics extends CryptoMetrics {
  readonly httpDuration: Histogram<'method' | 'route' | 'status_code'>;
  readonly routing: Counter<'decision'>;
  readonly batches: Counter<'event'>;

  constructor(registry: Registry) {
    super(registry, 'sync');
    this.httpDuration = new Histogram({
      name: 'keyfleet_http_request_duration_seconds',
      help: 'HTTP request duration by method, route template and status code.',
      labelNames: ['method', 'route', 'status_code'],
      buckets: [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10],
      registers: [registry],
    });
    const routing = new Tally<'decision'>();
    this.routing = new Counter({
      name: 'keyfleet_sync_routing_total',
      help: 'Crypto requests answered in the response (sync) or turned into a batch (async).',
      labelNames: ['decision'],
      registers: [registry],
      collect() {
        routing.addTo(this);
      },
    });
    this.#routing = { sync: routing.slot({ decision: 'sync' }), async: routing.slot({ decision: 'async' }) };
    this.batches = new Counter({
      name: 'keyfleet_batches_total',
      help: 'Batch lifecycle events seen by this API: created, cancelled, failed (uploads that did not complete, abandoned uploads), completed (only a batch whose chunks all ran before its upload was sealed); the rest of completed and failed are counted by workers.',
      labelNames: ['event'],
      registers: [registry],
    });
    // The HTTP histogram is left out: its routes x status codes are not known in advance.
    zeroed(this.routing, ROUTING_DECISIONS.map((decision) => ({ decision })));
    zeroed(this.batches, API_BATCH_EVENTS.map((event) => ({ event })));
  }

  readonly #requests = new Map<string, { observe(seconds: number): void }>();
  /** Times one answered request under its route template (never the raw URL) and status. */
  observeRequest(method: string, route: string, status: number, seconds: number): void {
    bound(this.#requests, `${method} ${route} ${status}`, () => this.httpDuration.labels({ method, route, status_code: String(status) })).observe(seconds);
  }

  readonly #routing: Record<'sync' | 'async', { n: number }>;
  countRouting(decision: 'sync' | 'async'): void {
    this.#routing[decision].n++;
  }
}

export class WorkerMetrics extends CryptoMetrics {
  readonly chunkDuration: Histogram<'op'>;
  readonly batches: Counter<'event'>;
  readonly chunks: Counter<'outcome'>;

  constructor(registry: Registry, pool: { busySeconds: number; queueSize: number; threads: number }) {
    super(registry, 'batch');
    this.chunkDuration = new Histogram({
      name: 'keyfleet_chunk_duration_seconds',
      help: 'Time to process one chunk in a worker: read inputs, crypto in a thread, store results.',
      labelNames: ['op'],
      buckets: [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30],
      registers: [registry],
    });
    this.batches = new Counter({
      name: 'keyfleet_batches_total',
      help: 'Batch lifecycle events decided by this worker: completed, failed.',
      labelNames: ['event'],
      registers: [registry],
    });
    this.chunks = new Counter({
      name: 'keyfleet_chunks_total',
      help: 'Chunks handled by this worker by outcome: counted, duplicate (a rerun, discarded), skipped (batch ended), failed.',
      labelNames: ['outcome'],
      registers: [registry],
    });
    zeroed(this.batches, WORKER_BATCH_EVENTS.map((event) => ({ event })));
    zeroed(this.chunks, CHUNK_OUTCOMES.map((outcome) => ({ outcome })));
    const poolGauge = (name: string, help: string, read: () => number): void => {
      new Gauge({ name, help, registers: [registry], collect() { this.set(read()); } });
    };
    new Counter({
      name: 'keyfleet_worker_pool_busy_seconds_total',
      help: 'Thread time spent running chunks, in seconds; its rate over keyfleet_worker_pool_threads is the pool\'s utilisation, 0..1.',
      registers: [registry],
      // The pool keeps the running total; each scrape reports it as it is.
      collect() {
        this.reset();
        this.inc(pool.busySeconds);
      },
    });
    poolGauge('keyfleet_worker_pool_queue_size', 'Chunks waiting for a free thread in this worker.', () => pool.queueSize);
    poolGauge('keyfleet_worker_pool_threads', 'Crypto threads in this worker.', () => pool.threads);
  }
}
