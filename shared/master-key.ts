import { createHash, randomBytes } from 'node:crypto';
import { gcmOpen, gcmSeal, KEY_BYTES, NONCE_BYTES } from './crypto/aes-gcm.js';

/**
 * Key material at rest: AES-256-GCM under the master key, bound to tenant, key name and version
 * as associated data so a wrapped value cannot be moved to another key. The stored form names
 * the master key by a short fingerprint, so a later master-key rotation can tell old from new.
 */
export class MasterKey {
  readonly #key: Buffer;
  readonly id: string;

  constructor(key: Buffer) {
    if (key.length !== KEY_BYTES) throw new Error(`master key: expected ${KEY_BYTES} bytes, got ${key.length}`);
    this.#key = key;
    this.id = createHash('sha256').update('keyfleet-master-key-id').update(key).digest('hex').slice(0, 8);
  }

  wrap(material: Buffer, tenant: string, keyName: string, version: number): string {
    const sealed = gcmSeal(this.#key, randomBytes(NONCE_BYTES), aad(tenant, keyName, version), material);
    return `w1:${this.id}:${sealed.toString('base64')}`;
  }

  unwrap(wrapped: string, tenant: string, keyName: string, version: number): Buffer {
    const [format, id, body] = wrapped.split(':');
    if (format !== 'w1' || id !== this.id || body === undefined) {
      throw new Error(`key ${keyName} v${version}: wrapped under another master key or format`);
    }
    const material = gcmOpen(this.#key, aad(tenant, keyName, version), Buffer.from(body, 'base64'));
    if (!material) throw new Error(`key ${keyName} v${version}: wrapped material failed authentication`);
    return material;
  }
}

const aad = (tenant: string, keyName: string, version: number): Buffer =>
  Buffer.from(`keyfleet-wrap:${tenant}:${keyName}:v${version}`, 'utf8');
