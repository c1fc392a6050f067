import { Buffer } from 'node:buffer';
import { itemError, type ErrorCode } from '../shared/errors.js';
import { openItem, plaintextBytes, plaintextText, sealItem, type Encoding } from '../shared/crypto/items.js';
import type { KeyRing } from '../shared/crypto/key-ring.js';
import { NonceSource } from '../shared/crypto/nonces.js';
import type { BatchOp } from '../shared/schemas.js';

export type ItemResult = { ciphertext: string } | { plaintext: string } | ReturnType<typeof itemError>;

export interface SyncRequest {
  readonly op: BatchOp;
  readonly items: readonly string[];
  readonly encoding: Encoding;
  readonly maxItemBytes: number;
}

// One nonce source per process: nonces are drawn from the CSPRNG in blocks, each used once.
const nonces = new NonceSource();

/**
 * The sync path: a few items, done on the API's own thread (no hand-off is cheaper than a
 * thread round trip for small requests). Returns one result per item, in order, and the
 * indices of items that named a key version newer than `ring` knows, for a retry on a fresh ring.
 */
export function runSync(request: SyncRequest, ring: KeyRing, only?: readonly number[]): { results: ItemResult[]; newer: number[] } {
  const results: ItemResult[] = new Array(request.items.length);
  const newer: number[] = [];
  const indices = only ?? request.items.keys();
  for (const i of indices) {
    const item = request.items[i]!;
    if (Buffer.byteLength(item, 'utf8') > request.maxItemBytes) {
      results[i] = itemError('KF_ITEM_TOO_LARGE');
      continue;
    }
    const outcome = runOne(request, ring, item);
    if (outcome === NEWER) {
      newer.push(i);
      results[i] = itemError('KF_DECRYPT_FAILED');
    } else {
      results[i] = typeof outcome === 'string' ? itemError(outcome) : outcome;
    }
  }
  return { results, newer };
}

const NEWER = Symbol('newer');

function runOne({ op, encoding }: SyncRequest, ring: KeyRing, item: string): ItemResult | ErrorCode | typeof NEWER {
  if (op === 'encrypt') {
    const plaintext = plaintextBytes(item, encoding);
    return plaintext ? { ciphertext: sealItem(ring, plaintext, nonces.next()) } : 'KF_INVALID_ENCODING';
  }
  const opened = openItem(ring, item);
  if (opened.code) return opened.newerVersion ? NEWER : opened.code;
  if (op === 'rewrap') return { ciphertext: sealItem(ring, opened.plaintext, nonces.next()) };
  const text = plaintextText(opened.plaintext, encoding);
  return text === undefined ? 'KF_NOT_UTF8' : { plaintext: text };
}
