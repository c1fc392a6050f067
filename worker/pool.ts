import { Piscina } from 'piscina';
import type { ChunkJob } from '../shared/crypto/chunk-kernel.js';
import type { KernelChoice } from '../shared/crypto/kernel.js';
import type { KeyRingData } from '../shared/crypto/key-ring.js';
import type { WorkerPriority } from '../shared/priority.js';
import { decodeResult, type DecodedResult, type ThreadTask } from './messages.js';

export interface CryptoPoolOptions {
  /** Threads in the pool; one per core by default (WORKER_THREADS). */
  readonly threads: number;
  /** Which crypto kernel the threads use: the native one where built (`auto`), or always `js`. */
  readonly kernel: KernelChoice;
  /** The threads' priority (WORKER_NICE, WORKER_SCHED). */
  readonly priority: WorkerPriority;
}

/** A worker_threads pool (piscina) that runs whole chunks; the main thread only moves buffers. */
export class CryptoPool {
  readonly #pool: Piscina<ThreadTask, Uint8Array>;
  readonly #kernel: KernelChoice;
  readonly #priority: WorkerPriority;
  #busySeconds = 0;

  constructor({ threads, kernel, priority }: CryptoPoolOptions) {
    this.#kernel = kernel;
    this.#priority = priority;
    if (!Number.isInteger(threads) || threads < 1) throw new RangeError(`CryptoPool: threads must be a positive integer, got ${threads}`);
    this.#pool = new Piscina({
      filename: new URL('./thread.js', import.meta.url).href,
      minThreads: threads,
      maxThreads: threads,
      // Tasks wait in piscina's queue rather than in BullMQ's: the worker's concurrency bounds them.
      idleTimeout: 60_000,
    });
  }

  /** Runs a chunk; `target` is the key a rewrap re-encrypts into, when it is not `ring`'s own latest version. */
  async run(job: ChunkJob, input: Buffer, ring: KeyRingData, target?: KeyRingData): Promise<DecodedResult> {
    const owned = ownsArrayBuffer(input) ? input : new Uint8Array(input);
    const task: ThreadTask = { job, input: owned, ring, ...(target ? { target } : {}), kernel: this.#kernel, priority: this.#priority };
    // Transfer, not copy: the chunk's bytes move to the thread and the result buffer moves back.
    const result = decodeResult(await this.#pool.run(task, { transferList: [owned.buffer as ArrayBuffer] }));
    this.#busySeconds += result.busyMs / 1000;
    return result;
  }

  /**
   * Thread time spent on chunks so far, in seconds, as the threads measured it. (piscina's own
   * `utilization` is 1,000 times too low in 5.3: it divides a mean already in milliseconds by
   * 1,000 again, then by a duration in milliseconds.)
   */
  get busySeconds(): number {
    return this.#busySeconds;
  }

  get queueSize(): number {
    return this.#pool.queueSize;
  }

  get threads(): number {
    return this.#pool.threads.length;
  }

  close(): Promise<void> {
    return this.#pool.close();
  }
}

/** True when the view spans its whole ArrayBuffer (not a slice of Node's shared pool), so it may be transferred. */
const ownsArrayBuffer = (view: Uint8Array): boolean => view.byteOffset === 0 && view.byteLength === view.buffer.byteLength;
