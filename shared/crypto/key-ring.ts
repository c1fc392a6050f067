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

/** The unwrapped versions of one key, ready for the crypto loop. Never serialised to a client. */
export class KeyRing {
  readonly name: string;
  readonly type: KeyType;
  readonly latestVersion: number;
  readonly minDecryptionVersion: number;
  readonly #versions = new Map<number, VersionEntry>();
  readonly #data: KeyRingData;

  constructor(data: KeyRingData) {
    this.#data = data;
    this.name = data.name;
    this.type = data.type;
    this.latestVersion = data.latestVersion;
    this.minDecryptionVersion = data.minDecryptionVersion;
    for (const v of data.versions) {
      this.#versions.set(v.version, { key: createSecretKey(v.material), aad: associatedData(data.name, v.version) });
    }
    if (!this.#versions.has(this.latestVersion)) {
      throw new Error(`key ring ${data.name}: latest version ${data.latestVersion} has no material`);
    }
  }

  /** The version new ciphertexts are made under. */
  get latest(): VersionEntry {
    return this.#versions.get(this.latestVersion)!;
  }

  version(v: number): VersionEntry | undefined {
    return this.#versions.get(v);
  }

  /** The versions as the native kernel takes them (material and associated data as bytes). */
  nativeVersions(): ReadonlyArray<{ version: number; key: Uint8Array; aad: Uint8Array }> {
    this.#native ??= this.#data.versions.map((v) => ({ version: v.version, key: v.material, aad: associatedData(this.name, v.version) }));
    return this.#native;
  }

  #native: ReadonlyArray<{ version: number; key: Uint8Array; aad: Uint8Array }> | undefined;

  toData(): KeyRingData {
    return this.#data;
  }
}
