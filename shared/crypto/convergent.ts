import { createHmac, createSecretKey, hkdfSync, type KeyObject } from 'node:crypto';

/** The per-version key of the nonce PRF, derived from the version's material (never stored). */
export function convergentNonceKey(material: Uint8Array): KeyObject {
  return createSecretKey(Buffer.from(hkdfSync('sha256', material, Buffer.from('keyfleet-convergent-v1'), 'nonce', 32)));
}

/**
 * A convergent key's nonce: HMAC-SHA256 under the version's nonce key of the context (length-
 * prefixed) and the plaintext, truncated — as Vault's convergent encryption (version 3) does.
 * The same plaintext and context give the same nonce, hence the same ciphertext; any other
 * pair gives another nonce, so no nonce is reused across different messages.
 */
export function convergentNonce(nonceKey: KeyObject, context: Buffer, plaintext: Buffer, size: number): Buffer {
  const length = Buffer.allocUnsafe(4);
  length.writeUInt32BE(context.length);
  return createHmac('sha256', nonceKey).update(length).update(context).update(plaintext).digest().subarray(0, size);
}
