import { createSecretKey, type KeyObject } from 'node:crypto';
import { convergentNonceKey } from './convergent.js';
import { associatedData } from './format.js';

/** Every key type; `legacy-aes256-cbc` keys are only imported, and only decrypt and rewrap. */
export const KEY_TYPES = ['aes256-gcm96', 'xchacha20-poly1305', 'legacy-aes256-cbc'] as const;
export type KeyType = (typeof KEY_TYPES)[number];
/** The types a key can be created with (its material made by keyfleet). */
export const CREATABLE_KEY_TYPES = ['aes256-gcm96', 'xchacha20-poly1305'] as const satisfies readonly KeyType[];

/** What a thread needs to rebuild a ring: plain data, cheap to post (32 bytes per version). */
export interface KeyRingData {
  readonly name: string;
  readonly type: KeyType;
  /** Same plaintext and context, same ciphertext (nonce derived, not drawn). */
  readonly convergent?: boolean;
  readonly latestVersion: number;
  readonly minDecryptionVersion: number;
  /** The lowest version a caller may ask to encrypt under (keyVersion); default 1. */
  readonly minEncryptionVersion?: number;
  /** Which making of the key this is: one deleted and made again under its name is another (default ''). */
  readonly incarnation?: string;
  readonly versions: ReadonlyArray<{ readonly version: number; readonly material: Uint8Array }>;
}

/**
 * One version: its material, its associated data without context, and node:crypto key objects
 * made on first use. On Node 24.21 (the images' runtime) a cipher or HMAC made from raw key
 * bytes took 11–20 µs on the bench machine and one made from a key object 1.4 µs; on Node 20
 * either took 1.4–2.5 µs.
 */
export class VersionEntry {
  readonly version: number;
  readonly material: Uint8Array;
  readonly aad: Buffer;
  #secretKey: KeyObject | undefined;
  #nonceKey: KeyObject | undefined;

  constructor(name: string, version: number, material: Uint8Array) {
    this.version = version;
    this.material = material;
    this.aad = associatedData(name, version);
  }

  /** The material as a key object (AES-256-GCM, and legacy AES-256-CBC). */
  get secretKey(): KeyObject {
    return (this.#secretKey ??= createSecretKey(this.material));
  }

  /** The convergent nonce PRF's key. */
  get nonceKey(): KeyObject {
    return (this.#nonceKey ??= convergentNonceKey(this.material));
  }
}

/** A version as the native kernel takes it: material and associated data as bytes. */
export interface NativeVersionEntry {
  readonly version: number;
  readonly key: Uint8Array;
  readonly aad: Uint8Array;
}

/**
 * Versions as the native kernel reads them, in one buffer: [u32 count][u32 stride], then per
 * version, in rising order, [u32 version][u32 aad length][32-byte key][aad], `stride` bytes
 * apart (little-endian). The kernel finds a version by binary search, in place: a key's number
 * of versions costs a call nothing (read from objects, each cost ~0.3 µs, and a sync request
 * on a key rotated daily for a year over 100 µs).
 */
export function packVersions(entries: readonly NativeVersionEntry[]): Uint8Array {
  const sorted = [...entries].sort((a, b) => a.version - b.version);
  const stride = 8 + 32 + Math.max(0, ...sorted.map((e) => e.aad.length));
  const packed = Buffer.alloc(8 + sorted.length * stride);
  packed.writeUInt32LE(sorted.length, 0);
  packed.writeUInt32LE(stride, 4);
  sorted.forEach(({ version, key, aad }, i) => {
    if (key.length !== 32 || (i > 0 && version === sorted[i - 1]!.version)) throw new RangeError(`version ${version}: a key of 32 bytes, and one entry per version`);
    const at = 8 + i * stride;
    packed.writeUInt32LE(version, at);
    packed.writeUInt32LE(aad.length, at + 4);
    packed.set(key, at + 8);
    packed.set(aad, at + 40);
  });
  return packed;
}

/** The unwrapped versions of one key, ready for the crypto loop. Never serialised to a client. */
export class KeyRing {
  readonly name: string;
  readonly type: KeyType;
  readonly convergent: boolean;
  readonly latestVersion: number;
  readonly minDecryptionVersion: number;
  readonly minEncryptionVersion: number;
  readonly incarnation: string;
  readonly #data: KeyRingData;
  readonly #versions = new Map<number, VersionEntry>();
  #native: Uint8Array | undefined;

  constructor(data: KeyRingData) {
    this.#data = data;
    this.name = data.name;
    this.type = data.type;
    this.convergent = data.convergent === true;
    this.latestVersion = data.latestVersion;
    this.minDecryptionVersion = data.minDecryptionVersion;
    this.minEncryptionVersion = data.minEncryptionVersion ?? 1;
    this.incarnation = data.incarnation ?? '';
    for (const v of data.versions) this.#versions.set(v.version, new VersionEntry(data.name, v.version, v.material));
    if (!this.#versions.has(this.latestVersion)) throw new Error(`key ring ${data.name}: latest version ${data.latestVersion} has no material`);
  }

  /** The version new ciphertexts are made under. */
  get latest(): VersionEntry {
    return this.#versions.get(this.latestVersion)!;
  }

  version(v: number): VersionEntry | undefined {
    return this.#versions.get(v);
  }

  /** The lowest version that may seal: none below minDecryptionVersion, whose ciphertexts would not open. */
  get minSealingVersion(): number {
    return Math.max(this.minEncryptionVersion, this.minDecryptionVersion);
  }

  /**
   * The same ring sealing under `version` (a caller's keyVersion): it must lie between
   * minSealingVersion and the latest, and still have its material.
   */
  pinned(version: number): KeyRing {
    if (version === this.latestVersion) return this;
    if (version < this.minSealingVersion || version > this.latestVersion || !this.#versions.has(version)) {
      throw new RangeError(`key ${this.name}: keyVersion ${version} is outside ${this.minSealingVersion}..${this.latestVersion}`);
    }
    return new KeyRing({ ...this.#data, latestVersion: version, versions: this.#data.versions.filter((v) => v.version <= version) });
  }

  /** True where the native OpenSSL kernel can do this key's work: random-nonce AES-GCM without context. */
  get nativeCapable(): boolean {
    return this.type === 'aes256-gcm96' && !this.convergent;
  }

  /** The versions as the native kernel takes them, packed (made on first use: most rings never meet it). */
  nativeVersions(): Uint8Array {
    return (this.#native ??= packVersions([...this.#versions.values()].map((v) => ({ version: v.version, key: v.material, aad: v.aad }))));
  }

  toData(): KeyRingData {
    return this.#data;
  }
}
