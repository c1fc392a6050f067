import { createCipheriv, createDecipheriv, type KeyObject } from 'node:crypto';

export const NONCE_BYTES = 12;
export const TAG_BYTES = 16;
export const KEY_BYTES = 32;

/** Throws unless every key given is an AES-256 key (KEY_BYTES long); `owner` names the caller. */
export function assertKeyBytes(owner: string, ...keys: ReadonlyArray<Uint8Array | undefined>): void {
  for (const key of keys) {
    if (key && key.length !== KEY_BYTES) throw new Error(`${owner}: expected a ${KEY_BYTES}-byte key, got ${key.length} bytes`);
  }
}

/** AES-256-GCM seal into `out` at `offset` as nonce ‖ ciphertext ‖ tag; returns the bytes written. */
export function gcmSealInto(key: KeyObject | Buffer, nonce: Buffer, aad: Buffer, plaintext: Buffer, out: Buffer, offset: number): number {
  const cipher = createCipheriv('aes-256-gcm', key, nonce, { authTagLength: TAG_BYTES });
  cipher.setAAD(aad);
  nonce.copy(out, offset);
  let at = offset + NONCE_BYTES;
  at += cipher.update(plaintext).copy(out, at);
  at += cipher.final().copy(out, at);
  at += cipher.getAuthTag().copy(out, at);
  return at - offset;
}

/** AES-256-GCM seal: returns nonce ‖ ciphertext ‖ tag. */
export function gcmSeal(key: KeyObject | Buffer, nonce: Buffer, aad: Buffer, plaintext: Buffer): Buffer {
  const out = Buffer.allocUnsafe(NONCE_BYTES + plaintext.length + TAG_BYTES);
  gcmSealInto(key, nonce, aad, plaintext, out, 0);
  return out;
}

/** AES-256-GCM open of nonce ‖ ciphertext ‖ tag; undefined on any failure, with no detail (no oracle). */
export function gcmOpen(key: KeyObject | Buffer, aad: Buffer, sealed: Buffer): Buffer | undefined {
  if (sealed.length < NONCE_BYTES + TAG_BYTES) return undefined;
  const nonce = sealed.subarray(0, NONCE_BYTES);
  const tag = sealed.subarray(sealed.length - TAG_BYTES);
  const body = sealed.subarray(NONCE_BYTES, sealed.length - TAG_BYTES);
  try {
    const decipher = createDecipheriv('aes-256-gcm', key, nonce, { authTagLength: TAG_BYTES });
    decipher.setAAD(aad);
    decipher.setAuthTag(tag);
    const head = decipher.update(body);
    const tail = decipher.final();
    return tail.length === 0 ? head : Buffer.concat([head, tail]);
  } catch {
    return undefined;
  }
}
