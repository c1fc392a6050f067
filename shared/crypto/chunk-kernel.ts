import { isUtf8 } from 'node:buffer';
import { forEachItem, ITEM_NOT_STRING, ITEM_OK } from '../chunk-codec.js';
import type { ErrorCode } from '../errors.js';
import { RECORD_PLAINTEXT_BASE64, RECORD_PLAINTEXT_UTF8, ResultWriter } from '../result-codec.js';
import type { BatchOp } from '../schemas.js';
import { itemLimit, openItem, plaintextBytes, sealItemBytes, type Encoding } from './items.js';
import type { KeyRing } from './key-ring.js';
import { NonceSource } from './nonces.js';

export interface ChunkJob {
  readonly op: BatchOp;
  readonly encoding: Encoding;
  /** The plaintext limit (MAX_ITEM_BYTES); inputs may be as large as a ciphertext of such a plaintext. */
  readonly maxItemBytes: number;
  /** Bound into every item's associated data (UTF-8). */
  readonly context?: string;
}

export interface ChunkOutcome {
  /** The result records in input order (shared/result-codec.ts), a view of the writer's buffer. */
  readonly records: Buffer;
  readonly count: number;
  readonly succeeded: number;
  readonly failed: number;
  /** A ciphertext named a version above the ring's latest: the ring may be stale, reload and rerun. */
  readonly newerVersionSeen: boolean;
}

/**
 * Runs one chunk: decodes the packed items, does the crypto and writes the result records.
 * Runs inside a worker thread; plain loops over buffers, one output buffer per chunk.
 */
export function runChunk(job: ChunkJob, packed: Buffer, ring: KeyRing, nonces: NonceSource = new NonceSource(), target: KeyRing = ring): ChunkOutcome {
  const context = job.context === undefined ? undefined : Buffer.from(job.context, 'utf8');
  const out = new ResultWriter();
  let succeeded = 0;
  let failed = 0;
  let newerVersionSeen = false;
  const fail = (code: ErrorCode): void => {
    out.error(code);
    failed++;
  };

  const limit = itemLimit(job.op, job.encoding, job.maxItemBytes);
  const count = forEachItem(packed, (flag, bytes) => {
    if (flag !== ITEM_OK) return fail(flag === ITEM_NOT_STRING ? 'KF_INVALID_ITEM' : 'KF_ITEM_TOO_LARGE');
    if (bytes.length > limit) return fail('KF_ITEM_TOO_LARGE');

    if (job.op === 'encrypt') {
      const plaintext = job.encoding === 'utf8' ? bytes : plaintextBytes(bytes.toString('latin1'), 'base64');
      if (!plaintext) return fail('KF_INVALID_ENCODING');
      out.ciphertext(ring.latestVersion, sealItemBytes(ring, plaintext, nonces, context));
      succeeded++;
      return;
    }

    const opened = openItem(ring, bytes.toString('latin1'), context);
    if (opened.code) {
      if (opened.newerVersion) newerVersionSeen = true;
      return fail(opened.code);
    }
    if (job.op === 'rewrap') {
      // Rewrap: into the latest version of the same key, or of the target key (migration).
      out.ciphertext(target.latestVersion, sealItemBytes(target, opened.plaintext, nonces, context));
    } else if (job.encoding === 'base64') {
      out.plaintext(opened.plaintext, RECORD_PLAINTEXT_BASE64);
    } else {
      if (!isUtf8(opened.plaintext)) return fail('KF_NOT_UTF8');
      out.plaintext(opened.plaintext, RECORD_PLAINTEXT_UTF8);
    }
    succeeded++;
  });

  return { records: out.bytes, count, succeeded, failed, newerVersionSeen };
}
