import type { ChunkJob } from '../shared/crypto/chunk-kernel.js';
import type { KernelChoice } from '../shared/crypto/kernel.js';
import type { KeyRingData } from '../shared/crypto/key-ring.js';
import type { WorkerPriority } from '../shared/priority.js';

/** What the pool posts to a thread: the chunk's packed inputs travel as a transferred buffer. */
export interface ThreadTask {
  readonly job: ChunkJob;
  readonly input: Uint8Array;
  readonly ring: KeyRingData;
  /** The key a rewrap re-encrypts into (migration), if not `ring` itself. */
  readonly target?: KeyRingData;
  readonly kernel: KernelChoice;
  /** The priority the thread gives itself before its first chunk. */
  readonly priority: WorkerPriority;
}

/**
 * What a thread answers: one transferable buffer, a 21-byte header
 * [u32le count][u32le succeeded][u32le failed][u8 newerVersionSeen][f64le busyMs] then the
 * result records (shared/result-codec.ts). busyMs is the thread's own time on the task.
 */
export const RESULT_HEADER_BYTES = 21;

export interface ResultHeader {
  readonly count: number;
  readonly succeeded: number;
  readonly failed: number;
  readonly newerVersionSeen: boolean;
  /** Milliseconds the thread spent on the chunk (not the time it waited for a thread). */
  readonly busyMs: number;
}

export function writeResultHeader(result: Uint8Array, { count, succeeded, failed, newerVersionSeen, busyMs }: ResultHeader): void {
  const view = new DataView(result.buffer, result.byteOffset, RESULT_HEADER_BYTES);
  view.setUint32(0, count, true);
  view.setUint32(4, succeeded, true);
  view.setUint32(8, failed, true);
  view.setUint8(12, newerVersionSeen ? 1 : 0);
  view.setFloat64(13, busyMs, true);
}

export interface DecodedResult extends ResultHeader {
  readonly results: Buffer;
}

export function decodeResult(result: Uint8Array): DecodedResult {
  const buf = Buffer.from(result.buffer, result.byteOffset, result.byteLength);
  return {
    count: buf.readUInt32LE(0),
    succeeded: buf.readUInt32LE(4),
    failed: buf.readUInt32LE(8),
    newerVersionSeen: buf[12] === 1,
    busyMs: buf.readDoubleLE(13),
    results: buf.subarray(RESULT_HEADER_BYTES),
  };
}
