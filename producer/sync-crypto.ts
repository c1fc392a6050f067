import { Buffer } from 'node:buffer';
import { ITEM_NOT_STRING, ITEM_OK, ITEM_TOO_LARGE } from '../shared/chunk-codec.js';
import { itemError, type ErrorCode } from '../shared/errors.js';
import { itemLimit, openItem, plaintextBytes, plaintextText, sealItem, type Encoding } from '../shared/crypto/items.js';
import { nativeJob, outputBound, resolveKernel, type KernelChoice } from '../shared/crypto/kernel.js';
import type { KeyRing } from '../shared/crypto/key-ring.js';
import { nativeKernel } from '../shared/crypto/native-kernel.js';
import { NonceSource } from '../shared/crypto/nonces.js';
import type { BatchOp } from '../shared/schemas.js';

export interface SyncRequest {
  readonly op: BatchOp;
  /** null: an item that is neither a string nor a valid item object; it fails alone as KF_INVALID_ITEM. */
  readonly items: ReadonlyArray<string | null>;
  readonly encoding: Encoding;
  readonly maxItemBytes: number;
  /** Each item's context (bound as associated data), where one was given. */
  readonly contexts?: ReadonlyArray<string | undefined>;
  /** Rewrap into this key instead of the latest version of the same key (migration). */
  readonly target?: KeyRing;
}

export interface SyncOutcome {
  /** The response body, `{"results":[…]}`, already serialised. */
  readonly body: string;
  readonly succeeded: number;
  readonly failed: number;
  /** A ciphertext named a version newer than the ring: reload the ring and run again. */
  readonly newerVersionSeen: boolean;
}

// One nonce source per process: nonces are drawn from the CSPRNG in blocks, each used once.
const nonces = new NonceSource();
const OPEN = '{"results":[';
const CLOSE = ']}';

/**
 * The sync path: a few items, done on the API's own thread (for small requests no hand-off
 * beats a thread round trip). With the native kernel the items are packed into one buffer and
 * the kernel writes the response body itself; without it, node:crypto item by item.
 */
export function runSync(request: SyncRequest, ring: KeyRing, kernel: KernelChoice): SyncOutcome {
  const native = resolveKernel(kernel) === 'native' && ring.nativeCapable && !request.contexts && !request.target;
  return native ? runNative(request, ring) : runJs(request, ring);
}

// Scratch buffers for the packed items and the kernel's output, reused by every call (the
// kernel call is synchronous). The body is a string made from the output: no Buffer per
// request, and node:http writes a string body in one piece with the headers.
let packedScratch: Buffer = Buffer.allocUnsafe(64 * 1024);
let outScratch: Buffer = Buffer.allocUnsafe(64 * 1024);
const grown = (buf: Buffer, size: number): Buffer => (buf.length >= size ? buf : Buffer.allocUnsafe(Math.max(size, buf.length * 2)));

function runNative({ op, items, encoding, maxItemBytes }: SyncRequest, ring: KeyRing): SyncOutcome {
  const limit = itemLimit(op, encoding, maxItemBytes);
  // UTF-8 takes at most 3 bytes per UTF-16 unit: an item within limit / 3 units is written
  // without being measured first (most are; a measure is a call into C++ per item).
  let size = 0;
  for (const item of items) size += 5 + (item === null ? 0 : Math.min(3 * item.length, limit));
  const packed = (packedScratch = grown(packedScratch, size));
  let at = 0;
  for (const item of items) {
    if (item === null || (3 * item.length > limit && Buffer.byteLength(item, 'utf8') > limit)) {
      packed[at] = item === null ? ITEM_NOT_STRING : ITEM_TOO_LARGE;
      packed.writeUInt32LE(0, at + 1);
      at += 5;
      continue;
    }
    const length = packed.write(item, at + 5, 'utf8');
    packed[at] = ITEM_OK;
    packed.writeUInt32LE(length, at + 1);
    at += 5 + length;
  }
  const job = nativeJob({ op, encoding, maxItemBytes }, ring, true);
  const out = (outScratch = grown(outScratch, outputBound(op, items.length, at)));
  const [written, , succeeded, failed, newerVersionSeen] = nativeKernel!.run(job.params, job.versions, packed.subarray(0, at), out);
  // The kernel ends every result with a comma; the last one gives way to the closing bracket.
  const results = written > 0 ? written - 1 : 0;
  // Ciphertexts, and errors, are ASCII; plaintexts are UTF-8.
  const body = OPEN + out.toString(op === 'decrypt' ? 'utf8' : 'latin1', 0, results) + CLOSE;
  // Plaintexts may have passed through the scratch buffer: do not leave them there.
  if (op === 'decrypt') out.fill(0, 0, written);
  packed.fill(0, 0, at);
  return { body, succeeded, failed, newerVersionSeen };
}

type ItemResult = { ciphertext: string } | { plaintext: string } | ReturnType<typeof itemError>;

function runJs(request: SyncRequest, ring: KeyRing): SyncOutcome {
  let failed = 0;
  let newerVersionSeen = false;
  const limit = itemLimit(request.op, request.encoding, request.maxItemBytes);
  const results = request.items.map((item, index): ItemResult => {
    const context = request.contexts?.[index];
    const outcome =
      item === null ? 'KF_INVALID_ITEM'
      : Buffer.byteLength(item, 'utf8') > limit ? 'KF_ITEM_TOO_LARGE'
      : runOne(request, ring, item, context === undefined ? undefined : Buffer.from(context, 'utf8'));
    if (typeof outcome !== 'string') return outcome;
    failed++;
    if (outcome === NEWER) newerVersionSeen = true;
    return itemError(outcome === NEWER ? 'KF_DECRYPT_FAILED' : outcome);
  });
  return { body: JSON.stringify({ results }), succeeded: results.length - failed, failed, newerVersionSeen };
}

const NEWER = 'newer';

function runOne({ op, encoding, target }: SyncRequest, ring: KeyRing, item: string, context: Buffer | undefined): ItemResult | ErrorCode | typeof NEWER {
  if (op === 'encrypt') {
    const plaintext = plaintextBytes(item, encoding);
    return plaintext ? { ciphertext: sealItem(ring, plaintext, nonces, context) } : 'KF_INVALID_ENCODING';
  }
  const opened = openItem(ring, item, context);
  if (opened.code) return opened.newerVersion ? NEWER : opened.code;
  if (op === 'rewrap') return { ciphertext: sealItem(target ?? ring, opened.plaintext, nonces, context) };
  const text = plaintextText(opened.plaintext, encoding);
  return text === undefined ? 'KF_NOT_UTF8' : { plaintext: text };
}
