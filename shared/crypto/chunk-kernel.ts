import { forEachItem, ITEM_NOT_STRING, ITEM_OK } from '../chunk-codec.js';
import { CATALOGUE, type ErrorCode } from '../errors.js';
import type { BatchOp } from '../schemas.js';
import { itemLimit, openItem, plaintextBytes, plaintextText, sealItem, type Encoding } from './items.js';
import type { KeyRing } from './key-ring.js';
import { NonceSource } from './nonces.js';

export interface ChunkJob {
  readonly op: BatchOp;
  readonly encoding: Encoding;
  /** Index of the chunk's first item within its batch; result lines carry absolute indices. */
  readonly firstIndex: number;
  /** The plaintext limit (MAX_ITEM_BYTES); inputs may be as large as a ciphertext of such a plaintext. */
  readonly maxItemBytes: number;
  /** Bound into every item's associated data (UTF-8). */
  readonly context?: string;
}

export interface ChunkOutcome {
  /** NDJSON result lines in input order, ready to be streamed to the caller as they are. */
  readonly lines: string;
  readonly count: number;
  readonly succeeded: number;
  readonly failed: number;
  /** A ciphertext named a version above the ring's latest: the ring may be stale, reload and rerun. */
  readonly newerVersionSeen: boolean;
}

const errorJson = Object.fromEntries(
  Object.entries(CATALOGUE).map(([code, { message }]) => [code, JSON.stringify({ code, message })]),
) as Record<ErrorCode, string>;

/**
 * Runs one chunk: decodes the packed items, does the crypto and formats the result lines.
 * Runs inside a worker thread; plain loops over buffers, one output string per chunk.
 */
export function runChunk(job: ChunkJob, packed: Buffer, ring: KeyRing, nonces: NonceSource = new NonceSource(), target: KeyRing = ring): ChunkOutcome {
  const context = job.context === undefined ? undefined : Buffer.from(job.context, 'utf8');
  let out = '';
  let succeeded = 0;
  let failed = 0;
  let newerVersionSeen = false;
  const fail = (i: number, code: ErrorCode): void => {
    out += `{"i":${i},"error":${errorJson[code]}}\n`;
    failed++;
  };

  const limit = itemLimit(job.op, job.encoding, job.maxItemBytes);
  const count = forEachItem(packed, (flag, bytes, index) => {
    const i = job.firstIndex + index;
    if (flag !== ITEM_OK) return fail(i, flag === ITEM_NOT_STRING ? 'KF_INVALID_ITEM' : 'KF_ITEM_TOO_LARGE');
    if (bytes.length > limit) return fail(i, 'KF_ITEM_TOO_LARGE');

    if (job.op === 'encrypt') {
      const plaintext = job.encoding === 'utf8' ? bytes : plaintextBytes(bytes.toString('latin1'), 'base64');
      if (!plaintext) return fail(i, 'KF_INVALID_ENCODING');
      out += `{"i":${i},"ciphertext":"${sealItem(ring, plaintext, nonces, context)}"}\n`;
      succeeded++;
      return;
    }

    const opened = openItem(ring, bytes.toString('latin1'), context);
    if (opened.code) {
      if (opened.newerVersion) newerVersionSeen = true;
      return fail(i, opened.code);
    }
    if (job.op === 'rewrap') {
      // Rewrap: into the latest version of the same key, or of the target key (migration).
      out += `{"i":${i},"ciphertext":"${sealItem(target, opened.plaintext, nonces, context)}"}\n`;
    } else {
      const text = plaintextText(opened.plaintext, job.encoding);
      if (text === undefined) return fail(i, 'KF_NOT_UTF8');
      out += `{"i":${i},"plaintext":${JSON.stringify(text)}}\n`;
    }
    succeeded++;
  });

  return { lines: out, count, succeeded, failed, newerVersionSeen };
}
