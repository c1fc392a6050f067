import type { KeyRing } from './crypto/key-ring.js';
import { KeyfleetError } from './errors.js';
import type { KeyStore } from './key-store.js';

interface Entry {
  readonly ring: Promise<KeyRing | undefined>;
  readonly loadedAt: number;
}

/**
 * Per-process cache of unwrapped key rings. An entry is trusted for `ttlMs` (so a rotation
 * reaches every process within that time); callers that meet a ciphertext of a newer version
 * than the cached latest ask for a fresh load at once, so a fresh version never fails to decrypt.
 */
export class KeyCache {
  readonly #store: KeyStore;
  readonly #ttlMs: number;
  readonly #entries = new Map<string, Entry>();

  constructor(store: KeyStore, ttlMs: number) {
    this.#store = store;
    this.#ttlMs = ttlMs;
  }

  /** The ring of a tenant's key; throws KF_KEY_NOT_FOUND when there is none. */
  async get(tenant: string, name: string, { fresh = false } = {}): Promise<KeyRing> {
    const id = `${tenant}\u0000${name}`;
    const now = Date.now();
    let entry = this.#entries.get(id);
    if (!entry || fresh || now - entry.loadedAt > this.#ttlMs) {
      entry = { ring: this.#store.loadRing(tenant, name), loadedAt: now };
      this.#entries.set(id, entry);
      // A failed load must not stay cached.
      const loading = entry;
      loading.ring.catch(() => {
        if (this.#entries.get(id) === loading) this.#entries.delete(id);
      });
    }
    const ring = await entry.ring;
    if (!ring) {
      this.#entries.delete(id);
      throw new KeyfleetError('KF_KEY_NOT_FOUND');
    }
    return ring;
  }

  /** Drops a key after a local change (rotate, policy) so this process sees it at once. */
  forget(tenant: string, name: string): void {
    this.#entries.delete(`${tenant}\u0000${name}`);
  }
}
