import sodium from 'sodium-native';

export const XCHACHA_NONCE_BYTES = 24;
const TAG = 16;

/** XChaCha20-Poly1305 (libsodium, IETF): returns nonce ‖ ciphertext ‖ tag. */
export function xchachaSeal(key: Uint8Array, nonce: Buffer, aad: Buffer, plaintext: Buffer): Buffer {
  const out = Buffer.allocUnsafe(XCHACHA_NONCE_BYTES + plaintext.length + TAG);
  nonce.copy(out, 0, 0, XCHACHA_NONCE_BYTES);
  sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(out.subarray(XCHACHA_NONCE_BYTES), plaintext, aad, null, out.subarray(0, XCHACHA_NONCE_BYTES), asBuffer(key));
  return out;
}

/** Opens nonce ‖ ciphertext ‖ tag; undefined on any failure, with no detail (no oracle). */
export function xchachaOpen(key: Uint8Array, aad: Buffer, sealed: Buffer): Buffer | undefined {
  if (sealed.length < XCHACHA_NONCE_BYTES + TAG) return undefined;
  const plaintext = Buffer.allocUnsafe(sealed.length - XCHACHA_NONCE_BYTES - TAG);
  try {
    sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(plaintext, null, sealed.subarray(XCHACHA_NONCE_BYTES), aad, sealed.subarray(0, XCHACHA_NONCE_BYTES), asBuffer(key));
    return plaintext;
  } catch {
    return undefined;
  }
}

const asBuffer = (bytes: Uint8Array): Buffer => (Buffer.isBuffer(bytes) ? bytes : Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength));
