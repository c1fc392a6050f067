import { isUtf8 } from 'node:buffer';
import type { ErrorCode } from '../errors.js';
import { gcmOpen, gcmSealInto, NONCE_BYTES, TAG_BYTES } from './aes-gcm.js';
import { convergentNonce } from './convergent.js';
import { associatedData, BASE64, formatCiphertext, parseCiphertext } from './format.js';
import type { KeyRing, VersionEntry } from './key-ring.js';
import { legacyOpen } from './legacy-cbc.js';
import type { NonceSource } from './nonces.js';
import { XCHACHA_NONCE_BYTES, xchachaOpen, xchachaSeal } from './xchacha.js';

export type Encoding = 'utf8' | 'base64';

/**
 * The largest item a caller may send for an operation, given MAX_ITEM_BYTES as the plaintext
 * limit: a base64 plaintext or a ciphertext of a maximal plaintext must still fit.
 */
export function itemLimit(op: 'encrypt' | 'decrypt' | 'rewrap', encoding: Encoding, maxPlaintextBytes: number): number {
  if (op === 'encrypt') return encoding === 'base64' ? Math.ceil(maxPlaintextBytes / 3) * 4 : maxPlaintextBytes;
  // nonce (up to 24) + tag + CBC padding, base64, `kf:v{version}:` — or hex(iv):hex(ct) of a legacy key
  return Math.max(Math.ceil((maxPlaintextBytes + 56) / 3) * 4 + 16, 2 * (maxPlaintextBytes + 32) + 1);
}


/** Turns a caller's plaintext string into bytes; undefined when `base64` was promised and not kept. */
export function plaintextBytes(text: string, encoding: Encoding): Buffer | undefined {
  if (encoding === 'utf8') return Buffer.from(text, 'utf8');
  return BASE64.test(text) ? Buffer.from(text, 'base64') : undefined;
}

/** Sealing and opening per key type, on nonce ‖ ciphertext ‖ tag. */
const SUITES = {
  'aes256-gcm96': {
    nonceBytes: NONCE_BYTES,
    seal: (v: VersionEntry, nonce: Buffer, aad: Buffer, plaintext: Buffer): Buffer => {
      const sealed = Buffer.allocUnsafe(NONCE_BYTES + plaintext.length + TAG_BYTES);
      gcmSealInto(v.secretKey, nonce, aad, plaintext, sealed, 0);
      return sealed;
    },
    open: (v: VersionEntry, aad: Buffer, sealed: Buffer): Buffer | undefined => gcmOpen(v.secretKey, aad, sealed),
  },
  'xchacha20-poly1305': {
    nonceBytes: XCHACHA_NONCE_BYTES,
    seal: (v: VersionEntry, nonce: Buffer, aad: Buffer, plaintext: Buffer): Buffer => xchachaSeal(v.material, nonce, aad, plaintext),
    open: (v: VersionEntry, aad: Buffer, sealed: Buffer): Buffer | undefined => xchachaOpen(v.material, aad, sealed),
  },
} as const;

/**
 * Seals under the ring's latest version: a random nonce from `nonces`, or for a convergent key
 * the nonce derived from context and plaintext. The context, if any, joins the associated data.
 */
export function sealItem(ring: KeyRing, plaintext: Buffer, nonces: NonceSource, context?: Buffer): string {
  return formatCiphertext(ring.latestVersion, sealItemBytes(ring, plaintext, nonces, context));
}

/** `sealItem`'s nonce ‖ ciphertext ‖ tag, before the text format (the version is the ring's latest). */
export function sealItemBytes(ring: KeyRing, plaintext: Buffer, nonces: NonceSource, context?: Buffer): Buffer {
  if (ring.type === 'legacy-aes256-cbc') throw new Error(`key ${ring.name}: legacy keys do not encrypt`);
  const suite = SUITES[ring.type];
  const v = ring.latest;
  const nonce = ring.convergent ? convergentNonce(v.nonceKey, context ?? EMPTY, plaintext, suite.nonceBytes) : nonces.next(suite.nonceBytes);
  return suite.seal(v, nonce, context ? associatedData(ring.name, v.version, context) : v.aad, plaintext);
}

export type OpenOutcome =
  | { readonly plaintext: Buffer; readonly code?: undefined }
  /** `newerVersion`: the ciphertext names a version above the ring's latest, so the ring may be stale. */
  | { readonly plaintext?: undefined; readonly code: ErrorCode; readonly newerVersion?: boolean };

const FAILED: OpenOutcome = { code: 'KF_DECRYPT_FAILED' };
const NEWER: OpenOutcome = { code: 'KF_DECRYPT_FAILED', newerVersion: true };
const DISABLED: OpenOutcome = { code: 'KF_KEY_VERSION_DISABLED' };
const EMPTY = Buffer.alloc(0);

/**
 * Opens a ciphertext of the ring's key — `kf:v…`, or for a legacy key one of the legacy CBC
 * shapes. Every failure of form or authenticity (or padding) is the one uniform KF_DECRYPT_FAILED.
 */
export function openItem(ring: KeyRing, text: string, context?: Buffer): OpenOutcome {
  if (ring.type === 'legacy-aes256-cbc') {
    const plaintext = legacyOpen(ring.latest.secretKey, text);
    return plaintext ? { plaintext } : FAILED;
  }
  const parsed = parseCiphertext(text);
  if (!parsed) return FAILED;
  if (parsed.version > ring.latestVersion) return NEWER;
  if (parsed.version < ring.minDecryptionVersion) return DISABLED;
  const v = ring.version(parsed.version);
  if (!v) return FAILED;
  const plaintext = SUITES[ring.type].open(v, context ? associatedData(ring.name, v.version, context) : v.aad, parsed.sealed);
  return plaintext ? { plaintext } : FAILED;
}

/** Renders decrypted bytes for the caller; undefined when `utf8` was asked of bytes that are not UTF-8. */
export function plaintextText(plaintext: Buffer, encoding: Encoding): string | undefined {
  if (encoding === 'base64') return plaintext.toString('base64');
  return isUtf8(plaintext) ? plaintext.toString('utf8') : undefined;
}
