import { availableParallelism } from 'node:os';
import { z } from 'zod';
import type { WorkerPriority } from './priority.js';
import { MAX_TIMER_MS } from './timers.js';
import { parseTokens, type TokenEntry } from './tokens.js';

const int = (min: number, max = Number.MAX_SAFE_INTEGER) => z.coerce.number().int().min(min).max(max);
/** Where a worker serves /metrics, /healthz and /readyz unless WORKER_METRICS_PORT says otherwise. */
export const DEFAULT_WORKER_METRICS_PORT = 9464;

/** A duration in milliseconds that ends up in a timer (setTimeout, BullMQ's lock and stall timers). */
const timerMs = (min: number) => z.coerce.number().int().min(min).max(MAX_TIMER_MS, `expected at most ${MAX_TIMER_MS} ms (2^31−1, the longest delay of Node's timers)`);
/** A duration in seconds that ends up in a timer as seconds × 1000. */
const timerSeconds = (min: number) => {
  const max = Math.floor(MAX_TIMER_MS / 1000);
  return z.coerce.number().int().min(min).max(max, `expected at most ${max} s (about 24.8 days: 2^31−1 ms, the longest delay of Node's timers)`);
};

/**
 * Redis refuses an expiry whose end, in milliseconds since 1970, passes 2^63−1: about 9.2e15 s
 * from now ("invalid expire time"). A batch's chunk inputs live twice the larger of
 * RESULT_TTL_SECONDS and a week (shared/batch-store.ts), so 2^52 s is the most it may be: doubled,
 * 2^53 s in ms is 9.007e18, within that end for millions of years.
 */
const MAX_RESULT_TTL_SECONDS = 2 ** 52;

const masterKey = z
  .string()
  .transform((value, ctx) => {
    const bytes = Buffer.from(value, 'base64');
    // The value is a secret: the message names its length, never its content.
    if (bytes.length !== 32 || bytes.toString('base64') !== value.trim()) {
      ctx.addIssue({ code: 'custom', message: `expected base64 of exactly 32 bytes, got ${value.length} characters decoding to ${bytes.length} bytes` });
      return z.NEVER;
    }
    return bytes;
  })
  .optional();

/**
 * The highest database number any Redis can have: its `databases` setting is at most 2^31−1.
 * Which ones a given Redis has (16 by default) only it knows, once connected.
 */
const MAX_REDIS_DATABASE = 2 ** 31 - 2;

/**
 * The databases a redis:// URL names, as the client reads them: the path (`/2`), else `?db=2`.
 * The client reads them with parseInt: `/abc` crashed the process at its first command, `/1x`
 * was database 1, and one Redis cannot select ran on database 0 after an error line. A URL that
 * does not parse names none here: the client refuses it as the process starts, as a fatal line too.
 */
function namedDatabases(url: string): string[] {
  let parsed: URL;
  try {
    parsed = new URL(url);
  } catch {
    return [];
  }
  const named = parsed.searchParams.getAll('db');
  if (parsed.pathname !== '' && parsed.pathname !== '/') named.push(parsed.pathname.slice(1));
  return named;
}

const isDatabase = (db: string): boolean => /^\d{1,10}$/.test(db) && Number(db) <= MAX_REDIS_DATABASE;

/**
 * A REDIS_URL's node URLs (one, or a cluster's seeds) as written, split only where the next URL
 * begins: a raw comma in a password, which the format check refuses, stays within its URL.
 */
const seedsAsWritten = (value: string): string[] => value.split(/,(?=\s*rediss?:\/\/)/i);
/** A REDIS_URL's node URLs, trimmed (npm start probes the first before the format is checked). */
export const redisUrls = (value: string): string[] => seedsAsWritten(value).map((url) => url.trim());

const envSchema = z.object({
  /** The Redis (for a cluster, its seed nodes, comma-separated). Refused when empty: REFUSED_EMPTY. */
  REDIS_URL: z
    .string()
    .refine((value) => value.trim() !== '', {
      message: 'set but empty: expected a redis:// or rediss:// URL, or no REDIS_URL at all for the default redis://127.0.0.1:6379',
      abort: true,
    })
    .regex(
      /^rediss?:\/\/[^,\s]+(,\s*rediss?:\/\/[^,\s]+)*$/,
      'expected a redis:// or rediss:// URL (for a cluster: a comma-separated list of node URLs; a comma in a password is written %2C)',
    )
    // Only a value of the right form is read for its databases: one error per value.
    .pipe(
      z
        .string()
        .refine(
          (value) => redisUrls(value).every((url) => namedDatabases(url).every(isDatabase)),
          `expected the database after the host to be a whole number from 0 to ${MAX_REDIS_DATABASE}, as in redis://host:6379/2`,
        ),
    )
    .default('redis://127.0.0.1:6379'),
  /** Talk to a Redis Cluster: REDIS_URL lists seed nodes. */
  REDIS_CLUSTER: z.enum(['true', 'false', '1', '0']).default('false'),
  HOST: z.string().min(1).default('127.0.0.1'),
  PORT: int(0, 65535).default(8080),
  KEYFLEET_TOKENS: z.string().optional(),
  KEYFLEET_MASTER_KEY: masterKey,
  /** During a master-key rotation: the other master key, still accepted to unwrap and open. */
  KEYFLEET_MASTER_KEY_PREVIOUS: masterKey,
  /** Redis key prefix; it must hold a `{hash tag}` so that every multi-key operation stays in one cluster slot. */
  KEYFLEET_PREFIX: z.string().regex(/^\{[^{}]+\}$/, 'expected a hash tag such as {keyfleet}').default('{keyfleet}'),
  /**
   * Above this many items an `auto` request becomes a batch. The bench's crossover finds the
   * sync path faster at nearly every size it measures, but a sync request holds the API's event
   * loop for its whole crypto: at 1,000 items 2.5–5 ms, at 10,000 10–12 ms, by host (README,
   * Performance).
   */
  SYNC_MAX_ITEMS: int(1, 100_000).default(1_000),
  /**
   * Items per queued chunk: large enough that queue and Redis costs are amortised (2,500-item
   * chunks cost Redis more CPU per million), small enough to bound memory and keep many chunks
   * for the threads of several workers (README, Performance).
   */
  CHUNK_ITEMS: int(1, 1_000_000).default(10_000),
  /**
   * A chunk also closes once its items take this many bytes: 10,000 items of 64 KiB would be a
   * 655 MB chunk, past Redis's 512 MB value limit and a worker's memory. 32-byte items fill a
   * 10,000-item chunk in ~370 KB, far below it.
   */
  CHUNK_BYTES: int(64 * 1024, 256 * 1024 * 1024).default(4 * 1024 * 1024),
  WORKER_THREADS: int(1, 256).default(availableParallelism()),
  /** Chunks one worker process holds at once; more than the thread count so Redis I/O overlaps crypto. */
  WORKER_CONCURRENCY: int(1, 1024).optional(),
  /** How long a batch's status and results stay once it ended. At most 2^52 s: Redis expiries hold twice it. */
  RESULT_TTL_SECONDS: z.coerce
    .number()
    .int()
    .min(60)
    .max(MAX_RESULT_TTL_SECONDS, `expected at most ${MAX_RESULT_TTL_SECONDS} s (2^52: chunk inputs live twice it, and Redis refuses an expiry past 2^63−1 ms since 1970)`)
    .default(86_400),
  /**
   * BullMQ lock on a chunk; a worker that dies loses its chunks to another after about this long.
   * Also BullMQ's stalled-check interval, a timer: at most 2^31−1 ms.
   */
  JOB_LOCK_MS: timerMs(1000).default(30_000),
  JOB_ATTEMPTS: int(1, 100).default(5),
  /** How long a process trusts its cached key versions before it looks for a rotation. */
  KEY_CACHE_TTL_MS: int(0).default(2_000),
  MAX_BODY_BYTES: int(1024).default(16 * 1024 * 1024),
  /**
   * The request bodies one API process holds at once (producer/body-budget.ts); past it a request
   * with a body is answered 503 KF_BUSY before its body is read. Uploads do not count: they are
   * streamed into chunks.
   */
  MAX_BODY_BYTES_IN_FLIGHT: int(1024).default(48 * 1024 * 1024),
  /**
   * The part of MAX_BODY_BYTES_IN_FLIGHT one tenant's bodies may hold at once (default half of
   * it): a tenant whose clients send slowly, or too much at once, cannot take the whole budget
   * and have every other tenant's requests answered 503.
   */
  MAX_TENANT_BODY_BYTES_IN_FLIGHT: int(1024).optional(),
  /**
   * The largest item; an NDJSON line may be up to 6× this plus its quotes (every byte escaped as
   * \u00XX). At most 16 MiB: the kernels count an item's bytes in 32 bits (6× included).
   */
  MAX_ITEM_BYTES: int(1, 16 * 1024 * 1024).default(64 * 1024),
  /** Items one batch may hold; the upload beyond it fails with 413 and the batch is never run. At most 4e9: indices are 32-bit in the kernels. */
  MAX_BATCH_ITEMS: int(1, 4_000_000_000).default(20_000_000),
  /** Batches one tenant may have queued or running at once; more get 429. */
  MAX_ACTIVE_BATCHES: int(1).default(32),
  /**
   * Backpressure: when the items stored and not yet processed, over every batch, pass this, new
   * batches get 429 with Retry-After. Each queued 32-byte item holds about 40 bytes of Redis memory (its results about 70).
   */
  MAX_BACKLOG_ITEMS: int(1).default(20_000_000),
  /**
   * An upload that sends nothing for this long is abandoned (its client or API died): its batch
   * fails as KF_UPLOAD_ABORTED and frees its tenant's slot, instead of staying queued. A timer
   * on every request body, so at most 2,147,483 s. (Idempotency claims last twice it, up to
   * 2^32 ms, but as a Redis PX, not a timer: pendingMs.)
   */
  UPLOAD_IDLE_SECONDS: timerSeconds(3).default(60),
  /** Sync crypto requests per second per tenant, counted in Redis so replicas share it; 0 turns it off. */
  SYNC_RATE_LIMIT: int(0).default(5_000),
  /** Signs webhooks (HMAC-SHA256); API and workers need the same one. Unset: callbackUrl is refused. */
  WEBHOOK_SECRET: z.string().min(16, 'expected at least 16 characters').optional(),
  /** Hosts webhooks may go to, comma-separated (`hooks.example.com`, `*.example.com`); empty: any. */
  WEBHOOK_ALLOWED_HOSTS: z.string().default(''),
  /**
   * Random 96-bit nonces: NIST SP 800-38D bounds one AES-GCM key to 2^32 encryptions. A key
   * version refuses to encrypt past NONCE_LIMIT, and rotates by itself at NONCE_ROTATE_SHARE of
   * it (0: never by itself — rotate yourself, and the limit refuses if you forget).
   */
  NONCE_LIMIT: int(1, 2 ** 32).default(2 ** 32),
  NONCE_ROTATE_SHARE: z.coerce.number().min(0).max(1).default(0.5),
  /**
   * How long an Idempotency-Key and the answer it gave are kept. Only ever a Redis EX of this
   * value, never doubled nor in ms: any safe integer is an expiry Redis takes.
   */
  IDEMPOTENCY_TTL_SECONDS: int(60).default(86_400),
  /**
   * Niceness of a worker process, its event loop and crypto threads alike (0 = as the API, 19 =
   * lowest). Where API and workers share cores, the sync path's requests then go first (bench:
   * isolation); on a machine of its own a worker runs as fast at any niceness.
   */
  WORKER_NICE: int(0, 19).default(19),
  /**
   * `idle`: the worker's threads also take Linux's SCHED_IDLE policy, a far smaller share of a
   * busy core than nice 19 gives (bench: isolation, where the gain over nice 19 was small); it
   * needs the native addon, and without it the niceness above is all there is. `normal`: the niceness alone. Like niceness it ranks
   * threads within one cgroup: containers apart are ranked by their CPU requests or weights.
   */
  WORKER_SCHED: z.enum(['idle', 'normal']).default('idle'),
  /**
   * How long a worker told to stop (SIGTERM, SIGINT) may take to finish the chunks in hand
   * before it exits anyway (exit 1), as when Redis is unreachable and no chunk can be stored:
   * those chunks are retaken after JOB_LOCK_MS. Below compose's 60 s stop grace period. A
   * timer, so at most 2,147,483 s.
   */
  WORKER_DRAIN_SECONDS: timerSeconds(1).default(50),
  /** Port of a worker's own HTTP server (/metrics, /healthz, /readyz); it listens on HOST. */
  WORKER_METRICS_PORT: int(0, 65535).default(DEFAULT_WORKER_METRICS_PORT),
  /** The crypto kernel: `auto` uses the native OpenSSL kernel where it was built, `js` always node:crypto. */
  KEYFLEET_KERNEL: z.enum(['auto', 'native', 'js']).default('auto'),
  LOG_LEVEL: z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']).default('info'),
  /**
   * `true`: the API logs every request as it comes and goes (two info lines each). Off by
   * default: at 18k sync requests/s they cost the API ~25% of its throughput (bench), and
   * /metrics counts and times every request by route and status anyway.
   */
  LOG_REQUESTS: z.enum(['true', 'false', '1', '0']).default('false'),
  /**
   * `true`: Bull Board's actions (pause, retry, add, edit, clean and remove jobs, empty a queue)
   * work for admin tokens. Off by default, the board only shows: removing or emptying chunk jobs
   * leaves their batches unfinished until their records expire, and a chunk job's data says what
   * a worker runs.
   */
  BULL_BOARD_ACTIONS: z.enum(['true', 'false', '1', '0']).default('false'),
});

export interface Config {
  readonly redisUrl: string;
  readonly redisCluster: boolean;
  readonly host: string;
  readonly port: number;
  readonly tokens: readonly TokenEntry[];
  readonly masterKey: Buffer | undefined;
  readonly previousMasterKey: Buffer | undefined;
  readonly prefix: string;
  readonly syncMaxItems: number;
  readonly chunkItems: number;
  readonly chunkBytes: number;
  readonly workerThreads: number;
  readonly workerConcurrency: number;
  readonly resultTtlSeconds: number;
  readonly jobLockMs: number;
  readonly jobAttempts: number;
  readonly keyCacheTtlMs: number;
  readonly maxBodyBytes: number;
  readonly maxBodyBytesInFlight: number;
  readonly maxTenantBodyBytesInFlight: number;
  readonly maxItemBytes: number;
  readonly maxBatchItems: number;
  readonly maxActiveBatches: number;
  readonly maxBacklogItems: number;
  readonly uploadIdleSeconds: number;
  readonly syncRateLimit: number;
  readonly idempotencyTtlSeconds: number;
  readonly nonceLimit: number;
  readonly nonceRotateShare: number;
  readonly webhookSecret: string | undefined;
  readonly webhookAllowedHosts: readonly string[];
  readonly workerMetricsPort: number;
  readonly workerPriority: WorkerPriority;
  readonly workerDrainSeconds: number;
  readonly kernel: 'auto' | 'native' | 'js';
  readonly logLevel: z.infer<typeof envSchema>['LOG_LEVEL'];
  readonly logRequests: boolean;
  readonly bullBoardActions: boolean;
}

export class ConfigError extends Error {
  override name = 'ConfigError';
}

/** Variables whose values are secrets: an error names their shape, never their content. */
const SECRET_VARIABLES = new Set(['KEYFLEET_MASTER_KEY', 'KEYFLEET_MASTER_KEY_PREVIOUS', 'KEYFLEET_TOKENS', 'WEBHOOK_SECRET']);

/**
 * A value as an error may show it: Redis URLs without user and password, up to each URL's last @
 * (a password may hold raw @, commas and newlines). A URL begins only where a comma is followed
 * by redis:// or rediss://, as in a cluster's seed list: split at every comma, a password with a
 * raw comma showed its pieces. Nor need a URL have its //: `redis:/:password@host` hides it too.
 * Nor a credential in its query: ioredis takes `?password=…` (and `username`, `sentinelPassword`)
 * from there as well; other parameters (`db`) stay, to be seen.
 */
export const shownRedisUrl = (value: string): string =>
  seedsAsWritten(value)
    .map((url) => url.replace(/^(\s*rediss?:\/*)?[\s\S]*@/i, '$1…@').replace(/([?&][^=&]*(?:pass|user|secret|token|auth)[^=&]*=)[^&]*/gi, '$1…'))
    .join(',');
const shown = (name: string, value: string | undefined): string => JSON.stringify(name === 'REDIS_URL' && value ? shownRedisUrl(value) : value);

/**
 * Variables refused when empty rather than read as unset. An empty REDIS_URL is most likely one
 * meant and lost (a Kubernetes Secret's key, set from an unset shell variable, takes precedence
 * over the ConfigMap's URL even when empty): its default, a Redis on the process's own loopback,
 * would be another Redis or none, found out only when the pod never gets ready.
 */
const REFUSED_EMPTY = new Set(['REDIS_URL']);

/** What a process cannot start without, each named as a start without it names it. */
export const REQUIRED = {
  KEYFLEET_TOKENS: 'required by the API (tenant:token[:scope+scope], comma-separated)',
  KEYFLEET_MASTER_KEY: 'required (base64 of 32 random bytes, e.g. `openssl rand -base64 32`)',
} as const;
export type RequiredSetting = keyof typeof REQUIRED;

/**
 * Parses the environment once into a frozen config; fails naming each bad variable and what was
 * expected. An empty variable counts as unset (`VAR=` in an env file, compose's `${VAR:-}`): its
 * default applies, rather than an empty string read as 0. Except REDIS_URL: refused when empty.
 * `required` names the settings the calling process cannot run without: one missing is
 * reported with every other bad variable, not at the next start.
 */
export function loadConfig(given: NodeJS.ProcessEnv = process.env, required: readonly RequiredSetting[] = []): Config {
  const env = Object.fromEntries(Object.entries(given).filter(([name, value]) => value !== undefined && (value.trim() !== '' || REFUSED_EMPTY.has(name))));
  const parsed = envSchema.safeParse(env);
  const problems = parsed.success
    ? []
    : parsed.error.issues.map((issue) => {
        const name = issue.path.join('.');
        return `${name}: ${issue.message}${SECRET_VARIABLES.has(name) ? '' : ` (got ${shown(name, env[name])})`}`;
      });
  // The checks beyond the schema run whatever else failed: one start names every bad variable.
  const valid = (name: string): boolean => parsed.success || !parsed.error.issues.some((issue) => issue.path[0] === name);
  const redisCluster = env['REDIS_CLUSTER'] === 'true' || env['REDIS_CLUSTER'] === '1';
  const redisUrl = env['REDIS_URL'];
  // The cluster client takes hosts and ports from the URLs, and would quietly use database 0.
  if (redisCluster && redisUrl !== undefined && valid('REDIS_URL') && redisUrls(redisUrl).some((url) => namedDatabases(url).some((db) => Number(db) !== 0))) {
    problems.push(`REDIS_URL: a Redis Cluster (REDIS_CLUSTER=true) has database 0 alone (got ${shown('REDIS_URL', redisUrl)})`);
  }
  let tokens: TokenEntry[] = [];
  try {
    if (env['KEYFLEET_TOKENS'] !== undefined) tokens = parseTokens(env['KEYFLEET_TOKENS']);
  } catch (err) {
    problems.push(`KEYFLEET_TOKENS: ${(err as Error).message}`);
  }
  for (const name of required) {
    // A token list of nothing but commas is set, and holds no token.
    const missing = name === 'KEYFLEET_TOKENS' ? tokens.length === 0 && !problems.some((p) => p.startsWith('KEYFLEET_TOKENS:')) : env[name] === undefined;
    if (missing) problems.push(`${name}: ${REQUIRED[name]}`);
  }
  if (!parsed.success || problems.length) throw new ConfigError(`invalid configuration:\n  ${problems.join('\n  ')}`);
  const e = parsed.data;
  return Object.freeze({
    redisUrl: e.REDIS_URL,
    redisCluster,
    host: e.HOST,
    port: e.PORT,
    tokens: Object.freeze(tokens),
    masterKey: e.KEYFLEET_MASTER_KEY,
    previousMasterKey: e.KEYFLEET_MASTER_KEY_PREVIOUS,
    prefix: e.KEYFLEET_PREFIX,
    syncMaxItems: e.SYNC_MAX_ITEMS,
    chunkItems: e.CHUNK_ITEMS,
    chunkBytes: e.CHUNK_BYTES,
    workerThreads: e.WORKER_THREADS,
    workerConcurrency: e.WORKER_CONCURRENCY ?? e.WORKER_THREADS * 2,
    resultTtlSeconds: e.RESULT_TTL_SECONDS,
    jobLockMs: e.JOB_LOCK_MS,
    jobAttempts: e.JOB_ATTEMPTS,
    keyCacheTtlMs: e.KEY_CACHE_TTL_MS,
    maxBodyBytes: e.MAX_BODY_BYTES,
    maxBodyBytesInFlight: e.MAX_BODY_BYTES_IN_FLIGHT,
    maxTenantBodyBytesInFlight: e.MAX_TENANT_BODY_BYTES_IN_FLIGHT ?? Math.floor(e.MAX_BODY_BYTES_IN_FLIGHT / 2),
    maxItemBytes: e.MAX_ITEM_BYTES,
    maxBatchItems: e.MAX_BATCH_ITEMS,
    maxActiveBatches: e.MAX_ACTIVE_BATCHES,
    maxBacklogItems: e.MAX_BACKLOG_ITEMS,
    uploadIdleSeconds: e.UPLOAD_IDLE_SECONDS,
    syncRateLimit: e.SYNC_RATE_LIMIT,
    idempotencyTtlSeconds: e.IDEMPOTENCY_TTL_SECONDS,
    nonceLimit: e.NONCE_LIMIT,
    nonceRotateShare: e.NONCE_ROTATE_SHARE,
    webhookSecret: e.WEBHOOK_SECRET,
    webhookAllowedHosts: Object.freeze(e.WEBHOOK_ALLOWED_HOSTS.split(',').map((h) => h.trim().toLowerCase()).filter(Boolean)),
    workerMetricsPort: e.WORKER_METRICS_PORT,
    workerPriority: Object.freeze({ nice: e.WORKER_NICE, idle: e.WORKER_SCHED === 'idle' }),
    workerDrainSeconds: e.WORKER_DRAIN_SECONDS,
    kernel: e.KEYFLEET_KERNEL,
    logLevel: e.LOG_LEVEL,
    logRequests: e.LOG_REQUESTS === 'true' || e.LOG_REQUESTS === '1',
    bullBoardActions: e.BULL_BOARD_ACTIONS === 'true' || e.BULL_BOARD_ACTIONS === '1',
  });
}

/** The master key, or a clear failure for processes that cannot run without one. */
export function requireMasterKey(config: Config): Buffer {
  if (!config.masterKey) {
    throw new ConfigError(`invalid configuration:\n  KEYFLEET_MASTER_KEY: ${REQUIRED.KEYFLEET_MASTER_KEY}`);
  }
  return config.masterKey;
}
