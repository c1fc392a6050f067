import type { KeyRing } from './crypto/key-ring.js';
import { KeyfleetError } from './errors.js';
import type { KeyCache } from './key-cache.js';
import type { Logger } from './logger.js';
import type { CryptoMetrics } from './metrics.js';
import type { ConnectionErrorLog } from './redis.js';

export interface NoncePolicy {
  /** NONCE_LIMIT: encryptions one random-nonce AES-GCM version may make. */
  readonly limit: number;
  /** NONCE_ROTATE_SHARE: the share of the limit at which the key rotates by itself (0: never). */
  readonly rotateShare: number;
}

/**
 * What happens around encryption: a key due for rotation (its autoRotatePeriod passed, or its
 * latest version used NONCE_ROTATE_SHARE of its nonce budget) rotates first; a version at its
 * NONCE_LIMIT refuses; encryptions are counted in Redis.
 *
 * Counts are gathered per version and written together: at once when a count is large (a
 * worker's chunk), else at most COUNT_FLUSH_MS later, so the sync path makes no Redis round
 * trip of its own for counting. Counts not yet written are part of what this process checks
 * against the budget; `flush()` writes them before the process closes its connections.
 */
export class KeyPolicy {
  readonly #cache: KeyCache;
  readonly #policy: NoncePolicy;
  readonly #metrics: CryptoMetrics;
  readonly #logger: Logger;
  readonly #errors: ConnectionErrorLog;
  /**
   * What this process knows of each version's encryptions, by tenant, key name and version:
   * nested maps, so that the sync path looks a version up without building a string for it.
   * A key deleted and made again under its name starts afresh (its ring's incarnation).
   */
  readonly #counts = new Map<string, Map<string, Map<number, VersionCount>>>();
  /** Counts with encryptions not yet written to Redis. */
  readonly #unwritten = new Set<VersionCount>();
  #flushTimer: NodeJS.Timeout | undefined;
  #maxUsed = 0;
  #closed = false;
  /** Writes refused in a row: the retry waits longer after each, up to RETRY_MAX_MS. */
  #refused = 0;

  /** `errors`: where a count that could not be written is logged (it is tried again, backing off from 100 ms to 5 s). */
  constructor(cache: KeyCache, policy: NoncePolicy, metrics: CryptoMetrics, logger: Logger, errors: ConnectionErrorLog) {
    this.#cache = cache;
    this.#policy = policy;
    this.#metrics = metrics;
    this.#logger = logger;
    this.#errors = errors;
  }

  /**
   * The ring to encrypt `count` items under, after any rotation that is due: sealing under the
   * latest version, or under `version` when the caller pins one. Either way the version that
   * seals is the one whose budget is checked (and counted, by `counted`): refused when the
   * items would take it past the limit. `fresh` reloads the key first.
   */
  async forEncryption(tenant: string, name: string, { version, fresh = false, count = 1 }: { version?: number; fresh?: boolean; count?: number } = {}): Promise<KeyRing> {
    let key = await this.#cache.loaded(tenant, name, { fresh });
    if (key.ring.type === 'legacy-aes256-cbc') {
      throw new KeyfleetError('KF_KEY_OPERATION_UNSUPPORTED', 'a legacy-aes256-cbc key only decrypts and rewraps (into another key with targetKey)');
    }
    const latest = key.ring.latestVersion;
    const used = this.#used(this.#count(tenant, key.ring, latest), key.encryptions.get(latest) ?? 0);
    const periodDue = key.autoRotatePeriod > 0 && Date.now() - key.latestCreatedMs >= key.autoRotatePeriod * 1000;
    const budgetDue = budgeted(key.ring) && this.#policy.rotateShare > 0 && used >= this.#policy.rotateShare * this.#policy.limit;
    if (periodDue || budgetDue) {
      await this.#rotate(tenant, name, latest, periodDue ? 'period' : 'nonce_budget');
      key = await this.#cache.loaded(tenant, name, { fresh: true });
    }
    const ring = version === undefined ? key.ring : pinned(key.ring, version);
    const sealingUsed = this.#used(this.#count(tenant, ring, ring.latestVersion), key.encryptions.get(ring.latestVersion) ?? 0);
    if (budgeted(ring) && sealingUsed + count > this.#policy.limit) throw new KeyfleetError('KF_NONCE_BUDGET_EXHAUSTED');
    return ring;
  }

  /** Counts `count` encryptions under `ring`'s latest version; never throws (counting must not fail the work done). */
  counted(tenant: string, ring: KeyRing, count: number): void {
    if (count <= 0) return;
    this.#pend(this.#count(tenant, ring, ring.latestVersion), ring, count);
    if (count >= COUNT_NOW) void this.flush();
    else this.#flushTimer ??= setTimeout(() => void this.flush(), COUNT_FLUSH_MS).unref();
  }

  /** Writes what is gathered, for the last time: a count Redis refuses now is logged as lost. */
  async close(): Promise<void> {
    this.#closed = true;
    await this.flush();
  }

  /** Writes every count gathered so far; resolves when Redis has them (or refused them: kept for the next flush). */
  async flush(): Promise<void> {
    clearTimeout(this.#flushTimer);
    this.#flushTimer = undefined;
    // Taken before any write starts: a write refused at once puts its count back for the next flush.
    const entries = [...this.#unwritten];
    this.#unwritten.clear();
    await Promise.all(entries.map((entry) => {
      const count = entry.pending;
      entry.pending = 0;
      return this.#write(entry, entry.ring!, count);
    }));
  }

  async #write(entry: VersionCount, ring: KeyRing, count: number): Promise<void> {
    const { tenant } = entry;
    const version = ring.latestVersion;
    let total: number;
    try {
      total = await this.#cache.store.countEncryptions(tenant, ring.name, ring.incarnation, version, count);
    } catch (err) {
      this.#errors.report('nonce-budget', err as Error, 'could not count encryptions');
      // Dropped, they would let the version pass its budget unseen: kept and written with a
      // later flush (twice, if only the reply was lost: the safe side for a nonce budget).
      if (this.#closed) {
        this.#logger.error({ tenant, key: ring.name, version, count }, 'encryptions left uncounted at close');
        return;
      }
      this.#pend(entry, ring, count);
      // Backing off: a Redis that refuses writes (out of memory, read-only) is not sent one more
      // 20 times a second by every replica.
      this.#refused++;
      this.#flushTimer ??= setTimeout(() => void this.flush(), Math.min(COUNT_FLUSH_MS * 2 ** this.#refused, RETRY_MAX_MS)).unref();
      return;
    }
    this.#refused = 0;
    // The key is gone: nothing is left for its nonces to repeat under.
    if (total < 0) return;
    entry.counted = total;
    if (!budgeted(ring)) return;
    this.#maxUsed = Math.max(this.#maxUsed, total / this.#policy.limit);
    this.#metrics.nonceBudgetUsed.set(this.#maxUsed);
    if (this.#policy.rotateShare > 0 && total >= this.#policy.rotateShare * this.#policy.limit) {
      await this.#rotate(tenant, ring.name, version, 'nonce_budget').catch((err: Error) => this.#logger.warn({ tenant, key: ring.name, err: { message: err.message } }, 'automatic rotation failed'));
    }
  }

  /** Adds `count` to what waits to be written for the version `entry` counts (`ring`'s latest). */
  #pend(entry: VersionCount, ring: KeyRing, count: number): void {
    entry.pending += count;
    entry.ring = ring;
    this.#unwritten.add(entry);
  }

  /** Encryptions under a version as far as this process knows: Redis's latest total, plus its own unwritten ones. */
  #used(entry: VersionCount, loaded: number): number {
    return Math.max(loaded, entry.counted) + entry.pending;
  }

  /**
   * The count of a version of `ring`'s key, made empty on first use and again for another making
   * of the key (what the old one still has to write is written, or dropped, on its own).
   */
  #count(tenant: string, ring: KeyRing, version: number): VersionCount {
    let names = this.#counts.get(tenant);
    if (names === undefined) this.#counts.set(tenant, (names = new Map()));
    let versions = names.get(ring.name);
    if (versions === undefined) names.set(ring.name, (versions = new Map()));
    let entry = versions.get(version);
    if (entry === undefined || entry.incarnation !== ring.incarnation) {
      versions.set(version, (entry = { tenant, incarnation: ring.incarnation, counted: 0, pending: 0, ring: undefined }));
    }
    return entry;
  }

  async #rotate(tenant: string, name: string, fromVersion: number, reason: 'period' | 'nonce_budget'): Promise<void> {
    const info = await this.#cache.store.rotate(tenant, name, fromVersion);
    this.#cache.forget(tenant, name);
    if (info.latestVersion === fromVersion + 1) {
      this.#metrics.autoRotations.inc({ reason });
      this.#logger.info({ tenant, key: name, reason, version: info.latestVersion }, 'key rotated automatically');
    }
  }

}

/** One version's encryptions as this process knows them. */
interface VersionCount {
  readonly tenant: string;
  /** The making of the key it counts (KeyRing.incarnation). */
  readonly incarnation: string;
  /** Redis's total as this process last heard it (after its own increments): fresher than the cached load. */
  counted: number;
  /** Made here and not yet written to Redis. */
  pending: number;
  /** The ring that made the pending ones (the version is its latest). */
  ring: KeyRing | undefined;
}

/** The ring sealing under a caller's keyVersion, or a clear 400. */
function pinned(ring: KeyRing, version: number): KeyRing {
  try {
    return ring.pinned(version);
  } catch {
    throw new KeyfleetError('KF_KEY_VERSION_INVALID', `keyVersion must be between ${ring.minSealingVersion} (minEncryptionVersion or minDecryptionVersion, the higher) and the latest version (${ring.latestVersion}), of a version that still exists`);
  }
}

/** How long a small count may wait to be written, and the count that is written at once. */
const COUNT_FLUSH_MS = 50;
/** The longest wait before a refused count is written again. */
const RETRY_MAX_MS = 5_000;
const COUNT_NOW = 1_000;

/** Only random 96-bit nonces have a budget: XChaCha20's 192-bit nonces and convergent nonces do not. */
const budgeted = (ring: KeyRing): boolean => ring.type === 'aes256-gcm96' && !ring.convergent;
