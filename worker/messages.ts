import type { ChunkJob } from '../shared/crypto/chunk-kernel.js';
import type { KeyRingData } from '../shared/crypto/key-ring.js';

/** What the pool posts to a thread: the chunk's packed inputs travel as a transferred buffer. */
export interface ThreadTask {
  readonly job: ChunkJob;
  readonly input: Uint8Array;
  readonly ring: KeyRingData;
}

/**
 * What a thread answers: one transferable buffer, a 13-byte header
 * [u32le count][u32le succeeded][u32le failed][u8 newerVersionSeen] then the NDJSON lines.
 */
export const RESULT_HEADER_BYTES = 13;

export function encodeResult(lines: string, count: number, succeeded: number, failed: number, newerVersionSeen: boolean): Uint8Array {
  const bytes = Buffer.byteLength(lines, 'utf8');
  // Its own ArrayBuffer (never Node's shared pool), so it can be transferred back whole.
  const out = Buffer.from(new ArrayBuffer(RESULT_HEADER_BYTES + bytes));
  out.writeUInt32LE(count, 0);
  out.writeUInt32LE(succeeded, 4);
  out.writeUInt32LE(failed, 8);
  out[12] = newerVersionSeen ? 1 : 0;
  out.write(lines, RESULT_HEADER_BYTES, 'utf8');
  return out;
}

export interface DecodedResult {
  readonly lines: Buffer;
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
    lines: buf.subarray(RESULT_HEADER_BYTES),
  };
}
