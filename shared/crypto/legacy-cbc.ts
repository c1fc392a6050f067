import { createDecipheriv, type KeyObject } from 'node:crypto';

const BLOCK = 16;
const HEX_SHAPE = /^([0-9a-fA-F]{32}):((?:[0-9a-fA-F]{32})+)$/;
const BASE64_SHAPE = /^[A-Za-z0-9+/]+={0,2}$/;

/**
 * The two shapes home-grown AES-256-CBC code commonly stores: `hex(iv):hex(ciphertext)` and
 * `base64(iv ‖ ciphertext)`, PKCS#7-padded. Undefined when the text is neither.
 */
export function parseLegacy(text: string): { iv: Buffer; ciphertext: Buffer } | undefined {
  const hex = HEX_SHAPE.exec(text);
  if (hex) return { iv: Buffer.from(hex[1]!, 'hex'), ciphertext: Buffer.from(hex[2]!, 'hex') };
  if (text.length % 4 !== 0 || !BASE64_SHAPE.test(text)) return undefined;
  const bytes = Buffer.from(text, 'base64');
  if (bytes.length < 2 * BLOCK || bytes.length % BLOCK !== 0) return undefined;
  return { iv: bytes.subarray(0, BLOCK), ciphertext: bytes.subarray(BLOCK) };
}

/**
 * Decrypts a legacy ciphertext. Every failure — shape, length, padding — is the same undefined:
 * the caller answers the one uniform KF_DECRYPT_FAILED. Success or failure is still a padding
 * oracle, which is why opening one needs the decrypt scope (producer/plugins/auth.ts). (CBC has
 * no integrity: a tampered ciphertext with valid padding decrypts to garbage; that is why legacy
 * keys only decrypt and rewrap, into an authenticated key.)
 */
export function legacyOpen(key: KeyObject | Uint8Array, text: string): Buffer | undefined {
  const parsed = parseLegacy(text);
  if (!parsed) return undefined;
  try {
    const decipher = createDecipheriv('aes-256-cbc', key, parsed.iv);
    return Buffer.concat([decipher.update(parsed.ciphertext), decipher.final()]);
  } catch {
    return undefined;
  }
}
