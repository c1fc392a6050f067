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
 * What a thread answers: one transferable buffer, a 13-byte header
 * [u32le count][u32le succeeded][u32le failed][u8 newerVersionSeen] then the result records
 * (shared/result-codec.ts).
 */
export const RESULT_HEADER_BYTES = 13;

export function writeResultHeader(result: Uint8Array, count: number, succeeded: number, failed: number, newerVersionSeen: boolean): void {
  const view = new DataView(result.buffer, result.byteOffset, RESULT_HEADER_BYTES);
  view.setUint32(0, count, true);
  view.setUint32(4, succeeded, true);
  view.setUint32(8, failed, true);
  view.setUint8(12, newerVersionSeen ? 1 : 0);
}

export interface DecodedResult {
  readonly results: Buffer;
  readonly count: number;
  readonly succeeded: number;
  readonly failed: number;
  readonly newerVersionSeen: boolean;
}

export function decodeResult(result: Uint8Array): DecodedResult {
  const buf = Buffer.from(result.buffer, result.byteOffset, result.byteLength);
  return {
    count: buf.readUInt32LE(0),
    succeeded: buf.readUInt32LE(4),
    failed: buf.readUInt32LE(8),
    newerVersionSeen: buf[12] === 1,
    results: buf.subarray(RESULT_HEADER_BYTES),
  };
}
