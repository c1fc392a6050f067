import { isUtf8 } from 'node:buffer';
import type { ErrorCode } from '../errors.js';
import { gcmOpen, gcmSealInto, NONCE_BYTES, TAG_BYTES } from './aes-gcm.js';
import { BASE64, formatCiphertext, parseCiphertext } from './format.js';
import type { KeyRing } from './key-ring.js';

export type Encoding = 'utf8' | 'base64';

/**
 * The largest item a caller may send for an operation, given MAX_ITEM_BYTES as the plaintext
 * limit: a base64 plaintext or a ciphertext of a maximal plaintext must still fit.
 */
export function itemLimit(op: 'encrypt' | 'decrypt' | 'rewrap', encoding: Encoding, maxPlaintextBytes: number): number {
  if (op === 'encrypt') return encoding === 'base64' ? Math.ceil(maxPlaintextBytes / 3) * 4 : maxPlaintextBytes;
  return Math.ceil((maxPlaintextBytes + 28) / 3) * 4 + 16; // nonce + tag, base64, `kf:v{version}:`
}


/** Turns a caller's plaintext string into bytes; undefined when `base64` was promised and not kept. */
export function plaintextBytes(text: string, encoding: Encoding): Buffer | undefined {
  if (encoding === 'utf8') return Buffer.from(text, 'utf8');
  return BASE64.test(text) ? Buffer.from(text, 'base64') : undefined;
}

/** Seals under the ring's latest version with the given 12-byte nonce. */
export function sealItem(ring: KeyRing, plaintext: Buffer, nonce: Buffer): string {
  const { key, aad } = ring.latest;
  const sealed = Buffer.allocUnsafe(NONCE_BYTES + plaintext.length + TAG_BYTES);
  gcmSealInto(key, nonce, aad, plaintext, sealed, 0);
  return formatCiphertext(ring.latestVersion, sealed);
}

export type OpenOutcome =
  | { readonly plaintext: Buffer; readonly code?: undefined }
  /** `newerVersion`: the ciphertext names a version above the ring's latest, so the ring may be stale. */
  | { readonly plaintext?: undefined; readonly code: ErrorCode; readonly newerVersion?: boolean };

const FAILED: OpenOutcome = { code: 'KF_DECRYPT_FAILED' };
const NEWER: OpenOutcome = { code: 'KF_DECRYPT_FAILED', newerVersion: true };
const DISABLED: OpenOutcome = { code: 'KF_KEY_VERSION_DISABLED' };

/** Opens a `kf:v…` ciphertext. Every failure of form or authenticity is the one uniform KF_DECRYPT_FAILED. */
export function openItem(ring: KeyRing, text: string): OpenOutcome {
  const parsed = parseCiphertext(text);
  if (!parsed) return FAILED;
  if (parsed.version > ring.latestVersion) return NEWER;
  if (parsed.version < ring.minDecryptionVersion) return DISABLED;
  const entry = ring.version(parsed.version);
  if (!entry) return FAILED;
  const plaintext = gcmOpen(entry.key, entry.aad, parsed.sealed);
  return plaintext ? { plaintext } : FAILED;
}

/** Renders decrypted bytes for the caller; undefined when `utf8` was asked of bytes that are not UTF-8. */
export function plaintextText(plaintext: Buffer, encoding: Encoding): string | undefined {
  if (encoding === 'base64') return plaintext.toString('base64');
  return isUtf8(plaintext) ? plaintext.toString('utf8') : undefined;
}
