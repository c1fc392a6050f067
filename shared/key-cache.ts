import type { KeyRing } from './crypto/key-ring.js';
import { keyNotFound } from './errors.js';
import type { KeyStore, LoadedKey } from './key-store.js';

interface Entry {
  readonly key: Promise<LoadedKey | undefined>;
  readonly loadedAt: number;
}

/**
 * Per-process cache of unwrapped keys. A change to a key (made, rotated, policy, trimmed,
 * deleted) is announced to every process, which forgets its entry (key-changes.ts); an entry
 * is trusted for `ttlMs` at most, the bound when an announcement is lost. Callers that meet a
 * ciphertext of a newer version than the cached latest ask for a fresh load at once, so a
 * fresh version never fails to decrypt.
 */
export class KeyCache {
  readonly #store: KeyStore;
  readonly #ttlMs: number;
  /** By tenant, then key name: no string is built per lookup. */
  readonly #entries = new Map<string, Map<string, Entry>>();

  constructor(store: KeyStore, ttlMs: number) {
    this.#store = store;
    this.#ttlMs = ttlMs;
  }

  get store(): KeyStore {
    return this.#store;
  }

  /** The ring of a tenant's key; throws KF_KEY_NOT_FOUND when there is none. */
  async get(tenant: string, name: string, options: { fresh?: boolean } = {}): Promise<KeyRing> {
    return (await this.loaded(tenant, name, options)).ring;
  }

  /** The key with what the encrypt path checks (encryptions so far, age of the latest version). */
  async loaded(tenant: string, name: string, { fresh = false } = {}): Promise<LoadedKey> {
    let entries = this.#entries.get(tenant);
    if (entries === undefined) this.#entries.set(tenant, (entries = new Map()));
    const now = Date.now();
    let entry = entries.get(name);
    if (!entry || fresh || now - entry.loadedAt > this.#ttlMs) {
      entry = { key: this.#store.load(tenant, name), loadedAt: now };
      entries.set(name, entry);
      // A failed load must not stay cached.
      const loading = entry;
      loading.key.catch(() => {
        if (entries.get(name) === loading) entries.delete(name);
      });
    }
    const key = await entry.key;
    if (!key) {
      entries.delete(name);
      throw keyNotFound(name);
    }
    return key;
  }

  /** Drops a key after a change (rotate, policy, delete) so this process sees it at once. */
  forget(tenant: string, name: string): void {
    this.#entries.get(tenant)?.delete(name);
  }

  /** Drops every key: after changes this process may not have heard of. */
  clear(): void {
    this.#entries.clear();
  }
}
