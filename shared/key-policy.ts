import type { KeyRing } from './crypto/key-ring.js';
import { KeyfleetError } from './errors.js';
import type { KeyCache } from './key-cache.js';
import type { Logger } from './logger.js';
import type { CryptoMetrics } from './metrics.js';

export interface NoncePolicy {
  /** NONCE_LIMIT: encryptions one random-nonce AES-GCM version may make. */
  readonly limit: number;
  /** NONCE_ROTATE_SHARE: the share of the limit at which the key rotates by itself (0: never). */
  readonly rotateShare: number;
}

/**
 * What happens around encryption: a key due for rotation (its autoRotatePeriod passed, or its
 * latest version used NONCE_ROTATE_SHARE of its nonce budget) rotates first; a version at its
 * NONCE_LIMIT refuses; encryptions are counted in Redis, one increment per chunk or request.
 */
export class KeyPolicy {
  readonly #cache: KeyCache;
  readonly #policy: NoncePolicy;
  readonly #metrics: CryptoMetrics;
  readonly #logger: Logger;
  /** Totals this process saw after its own increments, fresher than the cached load. */
  readonly #counted = new Map<string, number>();
  #maxUsed = 0;

  constructor(cache: KeyCache, policy: NoncePolicy, metrics: CryptoMetrics, logger: Logger) {
    this.#cache = cache;
    this.#policy = policy;
    this.#metrics = metrics;
    this.#logger = logger;
  }

  /** The ring to encrypt under, after any rotation that is due. */
  async forEncryption(tenant: string, name: string): Promise<KeyRing> {
    let key = await this.#cache.loaded(tenant, name);
    if (key.ring.type === 'legacy-aes256-cbc') {
      throw new KeyfleetError('KF_KEY_OPERATION_UNSUPPORTED', 'a legacy-aes256-cbc key only decrypts and rewraps (into another key with targetKey)');
    }
    const used = Math.max(key.latestEncryptions, this.#counted.get(this.#id(tenant, name, key.ring.latestVersion)) ?? 0);
    const periodDue = key.autoRotatePeriod > 0 && Date.now() - key.latestCreatedMs >= key.autoRotatePeriod * 1000;
    const budgetDue = budgeted(key.ring) && this.#policy.rotateShare > 0 && used >= this.#policy.rotateShare * this.#policy.limit;
    if (periodDue || budgetDue) {
      await this.#rotate(tenant, name, key.ring.latestVersion, periodDue ? 'period' : 'nonce_budget');
      key = await this.#cache.loaded(tenant, name, { fresh: true });
    }
    const latestUsed = Math.max(key.latestEncryptions, this.#counted.get(this.#id(tenant, name, key.ring.latestVersion)) ?? 0);
    if (budgeted(key.ring) && latestUsed >= this.#policy.limit) throw new KeyfleetError('KF_NONCE_BUDGET_EXHAUSTED');
    return key.ring;
  }

  /** Counts `count` encryptions under `ring`'s latest version; never throws (counting must not fail the work done). */
  counted(tenant: string, ring: KeyRing, count: number): void {
    if (count <= 0) return;
    const version = ring.latestVersion;
    this.#cache.store.countEncryptions(tenant, ring.name, version, count).then(
      async (total) => {
        this.#counted.set(this.#id(tenant, ring.name, version), total);
        if (!budgeted(ring)) return;
        this.#maxUsed = Math.max(this.#maxUsed, total / this.#policy.limit);
        this.#metrics.nonceBudgetUsed.set(this.#maxUsed);
        if (this.#policy.rotateShare > 0 && total >= this.#policy.rotateShare * this.#policy.limit) await this.#rotate(tenant, ring.name, version, 'nonce_budget');
      },
      (err: Error) => this.#logger.warn({ err: { message: err.message } }, 'could not count encryptions'),
    ).catch((err: Error) => this.#logger.warn({ err: { message: err.message } }, 'automatic rotation failed'));
  }

  async #rotate(tenant: string, name: string, fromVersion: number, reason: 'period' | 'nonce_budget'): Promise<void> {
    const info = await this.#cache.store.rotate(tenant, name, fromVersion);
    this.#cache.forget(tenant, name);
    if (info.latestVersion === fromVersion + 1) {
      this.#metrics.autoRotations.inc({ reason });
      this.#logger.info({ reason, version: info.latestVersion }, 'key rotated automatically');
    }
  }

  #id(tenant: string, name: string, version: number): string {
    return `${tenant}\u0000${name}\u0000${version}`;
  }
}

/** Only random 96-bit nonces have a budget: XChaCha20's 192-bit nonces and convergent nonces do not. */
const budgeted = (ring: KeyRing): boolean => ring.type === 'aes256-gcm96' && !ring.convergent;
