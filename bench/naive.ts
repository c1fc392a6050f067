import { createCipheriv, createSecretKey, randomBytes } from 'node:crypto';

/**
 * The reference: the straightforward per-item Node loop (randomBytes + createCipheriv +
 * update/final/getAuthTag + Buffer.concat + base64), one item at a time on one thread.
 * Returns the ciphertexts so the work cannot be optimised away. The key goes in as a key
 * object, so the reference does not slow down on Node 24, where a cipher made from raw key
 * bytes costs ~10 µs more (shared/crypto/key-ring.ts); on Node 20 either costs the same.
 */
export function naiveEncrypt(items: readonly string[], keyBytes: Buffer, aad: Buffer): string[] {
  const key = createSecretKey(keyBytes);
  const out = new Array<string>(items.length);
  for (let i = 0; i < items.length; i++) {
    const nonce = randomBytes(12);
    const cipher = createCipheriv('aes-256-gcm', key, nonce);
    cipher.setAAD(aad);
    const body = Buffer.concat([cipher.update(items[i]!, 'utf8'), cipher.final()]);
    out[i] = 'kf:v1:' + Buffer.concat([nonce, body, cipher.getAuthTag()]).toString('base64');
  }
  return out;
}

/** Items of 32 bytes, as in the reference figures. */
export function makeItems(n: number, prefix = 'item'): string[] {
  return Array.from({ length: n }, (_, i) => `${prefix}-${String(i).padStart(27 - prefix.length, '0')}`.slice(0, 32).padEnd(32, 'x'));
}

export function timeMs(fn: () => void): number {
  const start = process.hrtime.bigint();
  fn();
  return Number(process.hrtime.bigint() - start) / 1e6;
}
