import { createSecretKey, hkdfSync, randomBytes, type KeyObject } from 'node:crypto';
import { assertKeyBytes, gcmOpen, gcmSealInto, KEY_BYTES, NONCE_BYTES, TAG_BYTES } from './crypto/aes-gcm.js';

/** What sealing adds to a record: nonce and tag. */
export const SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES;

/** What a sealed record is: batch chunk inputs and results, or an idempotent answer. */
export type AtRestPurpose = 'batch' | 'idempotency';

const SALT = Buffer.from('keyfleet-at-rest-v1', 'utf8');

/**
 * Everything keyfleet keeps in Redis that may hold a plaintext — batch inputs (encrypt), batch
 * results (decrypt), idempotent answers — is sealed with AES-256-GCM under a data key derived
 * with HKDF-SHA256 from the master key for that one batch or record. A Redis dump then holds no
 * plaintext, and one record's data key opens no other. The associated data names the record
 * and its part, so a chunk cannot be swapped for another chunk or another batch's.
 */
export class AtRestSealer {
  // Key objects: node:crypto takes them for less per call than raw bytes (see key-ring.ts).
  readonly #master: KeyObject;
  readonly #previous: KeyObject | undefined;

  /** Seals under `masterKey`; opens under it or, during a master-key rotation, under `previous`. */
  constructor(masterKey: Buffer, previous?: Buffer) {
    assertKeyBytes('at-rest sealer', masterKey, previous);
    this.#master = createSecretKey(masterKey);
    this.#previous = previous && createSecretKey(previous);
  }

  /** Returns nonce ‖ ciphertext ‖ tag. */
  seal(purpose: AtRestPurpose, id: string, part: string, data: Buffer): Buffer {
    const out = Buffer.allocUnsafe(data.length + SEAL_OVERHEAD);
    this.sealInto(purpose, id, part, data, out);
    return out;
  }

  /** `seal` into `out` (at least `data.length + SEAL_OVERHEAD` bytes); returns the bytes written. */
  sealInto(purpose: AtRestPurpose, id: string, part: string, data: Buffer, out: Buffer): number {
    return gcmSealInto(this.#dataKey(this.#master, purpose, id), randomBytes(NONCE_BYTES), aad(purpose, id, part), data, out, 0);
  }

  /** Opens what `seal` made; throws (without detail) when it fails authentication. */
  open(purpose: AtRestPurpose, id: string, part: string, sealed: Buffer): Buffer {
    const data = gcmOpen(this.#dataKey(this.#master, purpose, id), aad(purpose, id, part), sealed) ??
      (this.#previous ? gcmOpen(this.#dataKey(this.#previous, purpose, id), aad(purpose, id, part), sealed) : undefined);
    if (!data) throw new Error(`${purpose} ${id}: stored ${part} failed authentication (another master key, or tampered)`);
    return data;
  }

  #dataKey(master: KeyObject, purpose: AtRestPurpose, id: string): KeyObject {
    return createSecretKey(Buffer.from(hkdfSync('sha256', master, SALT, `${purpose}:${id}`, KEY_BYTES)));
  }
}

const aad = (purpose: AtRestPurpose, id: string, part: string): Buffer => Buffer.from(`keyfleet-at-rest:${purpose}:${id}:${part}`, 'utf8');
