import { createHmac, timingSafeEqual } from 'node:crypto';

/** The header a webhook's signature travels in. */
export const SIGNATURE_HEADER = 'keyfleet-signature';

/**
 * Signs a webhook the way Stripe does: `t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
 * The timestamp is signed with the body, so a captured delivery cannot be replayed later.
 */
export function signWebhook(secret: string, body: string, timestamp = Math.floor(Date.now() / 1000)): string {
  return `t=${timestamp},v1=${hmac(secret, timestamp, body)}`;
}

export interface VerifyOptions {
  /** How far the signed time may be from now (default 300 s). */
  readonly toleranceSeconds?: number;
  /** Now, in unix seconds (default the clock). */
  readonly now?: number;
}

/**
 * Checks a delivery: the header's timestamp is recent and one of its `v1` signatures is the
 * HMAC of `<t>.<body>` under the secret, compared in constant time. `body` must be the raw
 * request body exactly as received (not re-serialised JSON).
 */
export function verifyWebhookSignature(secret: string, header: string | undefined | null, body: string | Buffer, { toleranceSeconds = 300, now = Math.floor(Date.now() / 1000) }: VerifyOptions = {}): boolean {
  if (!header) return false;
  let timestamp: number | undefined;
  const signatures: string[] = [];
  for (const part of header.split(',')) {
    const [name, value] = part.trim().split('=', 2);
    if (name === 't' && value && /^\d{1,12}$/.test(value)) timestamp = Number(value);
    else if (name === 'v1' && value && /^[0-9a-f]{64}$/.test(value)) signatures.push(value);
  }
  if (timestamp === undefined || signatures.length === 0 || Math.abs(now - timestamp) > toleranceSeconds) return false;
  const expected = Buffer.from(hmac(secret, timestamp, body), 'hex');
  let valid = false;
  for (const signature of signatures) valid = timingSafeEqual(expected, Buffer.from(signature, 'hex')) || valid;
  return valid;
}

const hmac = (secret: string, timestamp: number, body: string | Buffer): string =>
  createHmac('sha256', secret).update(`${timestamp}.`).update(body).digest('hex');
