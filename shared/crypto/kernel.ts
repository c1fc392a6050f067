import { lineBound, RESULTS_FORMAT, type NativeFormatter } from '../result-codec.js';
import { runChunk, type ChunkJob } from './chunk-kernel.js';
import { itemLimit } from './items.js';
import type { KeyRing } from './key-ring.js';
import { nativeKernel, nativeKernelUnavailable, type NativeJob } from './native-kernel.js';
import type { NonceSource } from './nonces.js';

export type KernelChoice = 'auto' | 'native' | 'js';

export interface KernelOutput {
  /** `reserve` bytes left free at the front, then the result records. Its own ArrayBuffer: transferable. */
  readonly buffer: Uint8Array;
  readonly count: number;
  readonly succeeded: number;
  readonly failed: number;
  readonly newerVersionSeen: boolean;
  readonly kernel: 'native' | 'js';
}

const OPS = { encrypt: 0, decrypt: 1, rewrap: 2 } as const;

/** Which kernel a choice resolves to on this machine; `native` where it was not built is a start-up error. */
export function resolveKernel(choice: KernelChoice): 'native' | 'js' {
  if (choice === 'native' && !nativeKernel) throw new Error(`KEYFLEET_KERNEL=native, but the native kernel is not built (${nativeKernelUnavailable}); run npm run build:native`);
  return choice === 'js' || !nativeKernel ? 'js' : 'native';
}

/** The native formatter of result records where `choice` resolves to the native kernel; else undefined (the JavaScript one). */
export function resultFormatter(choice: KernelChoice): NativeFormatter | undefined {
  return resolveKernel(choice) === 'native' ? nativeKernel : undefined;
}

/**
 * An upper bound on a sync response's items: each item's JSON (field names, error JSON) plus
 * the payload expanded by base64 (4/3) or, for plaintexts, by JSON escaping (at most 6×).
 */
export function outputBound(op: ChunkJob['op'], items: number, inputBytes: number): number {
  const perItem = lineBound(0); // an item's JSON without its payload, the longest error's included
  return items * perItem + (op === 'decrypt' ? 5 * inputBytes : Math.ceil((inputBytes + 28 * items) * 4 / 3) + 4 * items);
}

/**
 * An upper bound on a chunk's result records (the native kernel's, AES-GCM): a 5-byte header
 * and a version per item, nonce and tag added to a plaintext; a plaintext, decoded or
 * re-sealed item is never longer than its input.
 */
export function recordsBound(items: number, inputBytes: number): number {
  return 1 + items * (9 + 12 + 16) + inputBytes; // 1: the format byte
}

const PARAMS = new Uint32Array(new ArrayBuffer(28));

export function nativeJob(job: ChunkJob, ring: KeyRing, json: boolean): NativeJob {
  // One params array per thread, reused: calls are synchronous, and a fresh small typed array
  // would have to be externalised by V8 for N-API on every call.
  const params = PARAMS;
  params[0] = OPS[job.op];
  params[1] = job.op === 'decrypt' && job.encoding === 'base64' ? 1 : 0;
  params[2] = job.op === 'encrypt' && job.encoding === 'base64' ? 1 : 0;
  params[3] = json ? 1 : 0;
  params[4] = itemLimit(job.op, job.encoding, job.maxItemBytes);
  params[5] = ring.latestVersion;
  params[6] = ring.minDecryptionVersion;
  return { params, versions: ring.nativeVersions() };
}

/**
 * Runs one chunk with the native kernel where it is built, else with the node:crypto one.
 * Both write the same result records (the format byte first), and each decrypts what the other encrypts.
 */
export function runChunkInto(job: ChunkJob, packed: Uint8Array, ring: KeyRing, reserve: number, choice: KernelChoice, nonces: NonceSource, target?: KeyRing): KernelOutput {
  // The native kernel does random-nonce AES-GCM of one key without context; anything else
  // (XChaCha20, convergent, legacy CBC, context, rewrap into another key) is node:crypto/libsodium.
  if (resolveKernel(choice) === 'native' && ring.nativeCapable && job.context === undefined && !target) {
    const items = countItems(packed);
    const out = new Uint8Array(new ArrayBuffer(reserve + recordsBound(items, packed.length)));
    // The format byte, then the kernel's records.
    out[reserve] = RESULTS_FORMAT;
    const { params, versions } = nativeJob(job, ring, false);
    const [written, count, succeeded, failed, newerVersionSeen] = nativeKernel!.run(params, versions, packed, out.subarray(reserve + 1));
    return { buffer: out.subarray(0, reserve + 1 + written), count, succeeded, failed, newerVersionSeen, kernel: 'native' };
  }
  const input = Buffer.from(packed.buffer, packed.byteOffset, packed.byteLength);
  const result = runChunk(job, input, ring, nonces, target);
  const out = Buffer.from(new ArrayBuffer(reserve + result.records.length));
  result.records.copy(out, reserve);
  return { buffer: out, count: result.count, succeeded: result.succeeded, failed: result.failed, newerVersionSeen: result.newerVersionSeen, kernel: 'js' };
}

/** Items in a packed chunk, by walking the length headers. */
function countItems(packed: Uint8Array): number {
  const view = new DataView(packed.buffer, packed.byteOffset, packed.byteLength);
  let n = 0;
  for (let at = 0; at + 5 <= packed.length; at += 5 + view.getUint32(at + 1, true)) n++;
  return n;
}
