import { createHash, randomBytes } from 'node:crypto';
import { assertKeyBytes, gcmOpen, gcmSeal, NONCE_BYTES } from './crypto/aes-gcm.js';

/**
 * Key material at rest: AES-256-GCM under the master key, bound to tenant, key name and version
 * as associated data so a wrapped value cannot be moved to another key. The stored form names
 * the master key by a short fingerprint, so during a master-key rotation the process can tell
 * which of its keys opens a value: it wraps under `current`, and unwraps under `current` or
 * the `previous` one (KEYFLEET_MASTER_KEY_PREVIOUS) until everything is rewrapped.
 */
export class MasterKey {
  readonly #current: Buffer;
  readonly #previous: Buffer | undefined;
  readonly id: string;
  readonly previousId: string | undefined;

  constructor(current: Buffer, previous?: Buffer) {
    assertKeyBytes('master key', current, previous);
    this.#current = current;
    this.#previous = previous;
    this.id = fingerprint(current);
    this.previousId = previous ? fingerprint(previous) : undefined;
  }

  wrap(material: Buffer, tenant: string, keyName: string, version: number): string {
    const sealed = gcmSeal(this.#current, randomBytes(NONCE_BYTES), aad(tenant, keyName, version), material);
    return `w1:${this.id}:${sealed.toString('base64')}`;
  }

  unwrap(wrapped: string, tenant: string, keyName: string, version: number): Buffer {
    const [format, id, body] = wrapped.split(':');
    const key = id === this.id ? this.#current : id === this.previousId ? this.#previous : undefined;
    if (format !== 'w1' || !key || body === undefined) {
      throw new Error(`key ${keyName} v${version}: wrapped under another master key or format`);
    }
    const material = gcmOpen(key, aad(tenant, keyName, version), Buffer.from(body, 'base64'));
    if (!material) throw new Error(`key ${keyName} v${version}: wrapped material failed authentication`);
    return material;
  }

  /** True when a wrapped value is under the current master key already. */
  isCurrent(wrapped: string): boolean {
    return wrapped.startsWith(`w1:${this.id}:`);
  }
}

const fingerprint = (key: Buffer): string => createHash('sha256').update('keyfleet-master-key-id').update(key).digest('hex').slice(0, 8);

const aad = (tenant: string, keyName: string, version: number): Buffer =>
  Buffer.from(`keyfleet-wrap:${tenant}:${keyName}:v${version}`, 'utf8');
