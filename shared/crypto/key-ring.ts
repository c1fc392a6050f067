import { createSecretKey, type KeyObject } from 'node:crypto';
import { associatedData } from './format.js';

export const KEY_TYPES = ['aes256-gcm96'] as const;
export type KeyType = (typeof KEY_TYPES)[number];

/** What a thread needs to rebuild a ring: plain data, cheap to post (32 bytes per version). */
export interface KeyRingData {
  readonly name: string;
  readonly type: KeyType;
  readonly latestVersion: number;
  readonly minDecryptionVersion: number;
  readonly versions: ReadonlyArray<{ readonly version: number; readonly material: Uint8Array }>;
}

interface VersionEntry {
  readonly key: KeyObject;
  readonly aad: Buffer;
}

/** A version as the native kernel takes it: material and associated data as bytes. */
export interface NativeVersionEntry {
  readonly version: number;
  readonly key: Uint8Array;
  readonly aad: Uint8Array;
}

/**
 * The unwrapped versions of one key, ready for the crypto loop. Never serialised to a client.
 * Associated data is computed once per version; node:crypto KeyObjects only when the
 * node:crypto kernel first asks for one (the native kernel takes the bytes).
 */
export class KeyRing {
  readonly name: string;
  readonly type: KeyType;
  readonly latestVersion: number;
  readonly minDecryptionVersion: number;
  readonly #data: KeyRingData;
  readonly #native: readonly NativeVersionEntry[];
  readonly #keyObjects = new Map<number, VersionEntry>();

  constructor(data: KeyRingData) {
    this.#data = data;
    this.name = data.name;
    this.type = data.type;
    this.latestVersion = data.latestVersion;
    this.minDecryptionVersion = data.minDecryptionVersion;
    this.#native = data.versions.map((v) => ({ version: v.version, key: v.material, aad: associatedData(data.name, v.version) }));
    if (!this.#native.some((v) => v.version === this.latestVersion)) {
      throw new Error(`key ring ${data.name}: latest version ${data.latestVersion} has no material`);
    }
  }

  /** The version new ciphertexts are made under. */
  get latest(): VersionEntry {
    return this.version(this.latestVersion)!;
  }

  version(v: number): VersionEntry | undefined {
    let entry = this.#keyObjects.get(v);
    if (!entry) {
      const bytes = this.#native.find((n) => n.version === v);
      if (!bytes) return undefined;
      entry = { key: createSecretKey(bytes.key), aad: Buffer.from(bytes.aad) };
      this.#keyObjects.set(v, entry);
    }
    return entry;
  }

  /** The versions as the native kernel takes them. */
  nativeVersions(): readonly NativeVersionEntry[] {
    return this.#native;
  }

  toData(): KeyRingData {
    return this.#data;
  }
}
