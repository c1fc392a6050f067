/**
 * The ciphertext format `kf:v{version}:{base64(nonce ‖ ciphertext ‖ tag)}` and the associated
 * data that binds a ciphertext to its key: the UTF-8 bytes of `kf:{keyName}:v{version}`, and,
 * when the caller gives a context, a zero byte and the context's UTF-8 bytes after them (key
 * names hold no zero byte, so the two forms never collide).
 */
export const KEY_NAME = /^[A-Za-z0-9._-]{1,128}$/;

export function associatedData(keyName: string, version: number, context?: Buffer): Buffer {
  const base = Buffer.from(`kf:${keyName}:v${version}`, 'utf8');
  return context ? Buffer.concat([base, ZERO, context]) : base;
}

const ZERO = Buffer.alloc(1);

export function formatCiphertext(version: number, sealed: Buffer): string {
  return `kf:v${version}:${sealed.toString('base64')}`;
}

export interface ParsedCiphertext {
  readonly version: number;
  readonly sealed: Buffer;
}

const MAX_VERSION_DIGITS = 9;
/**
 * Canonical base64 (RFC 4648 §3.5): standard alphabet, padded, and the bits padding leaves over
 * are zero. A lenient decoder would accept several spellings of one ciphertext; keyfleet accepts
 * exactly the one it writes, so a ciphertext compares equal only to itself.
 */
export const BASE64 = /^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/][AQgw]==|[A-Za-z0-9+/]{2}[AEIMQUYcgkosw048]=)?$/;

/** Parses the textual format; undefined when it is not one (the caller reports the uniform decrypt error). */
export function parseCiphertext(text: string): ParsedCiphertext | undefined {
  if (!text.startsWith('kf:v')) return undefined;
  const colon = text.indexOf(':', 4);
  // One spelling per version as well: no leading zeros.
  if (colon < 5 || colon - 4 > MAX_VERSION_DIGITS || text.charCodeAt(4) === 48) return undefined;
  let version = 0;
  for (let i = 4; i < colon; i++) {
    const d = text.charCodeAt(i) - 48;
    if (d < 0 || d > 9) return undefined;
    version = version * 10 + d;
  }
  if (version < 1) return undefined;
  const body = text.slice(colon + 1);
  // Canonical base64, exactly as the native kernel decodes it.
  if (!BASE64.test(body)) return undefined;
  return { version, sealed: Buffer.from(body, 'base64') };
}
