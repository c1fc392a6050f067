import { setImmediate } from 'node:timers/promises';
import { KeyfleetError } from '../shared/errors.js';
import type { Queue } from 'bullmq';
import type { BatchStore, BatchSpec } from '../shared/batch-store.js';
import { SEAL_OVERHEAD } from '../shared/at-rest.js';
import { ChunkPacker, ITEM_NOT_STRING, ITEM_TOO_LARGE } from '../shared/chunk-codec.js';
import { nativeKernel } from '../shared/crypto/native-kernel.js';
import { chunkJobId, CHUNK_JOB } from '../shared/queue.js';
import type { ChunkJobData } from '../shared/schemas.js';

/** Chunk writes (store + enqueue) an upload keeps in flight: memory stays at a few chunks. */
const MAX_IN_FLIGHT = 3;

interface SealedChunk {
  readonly chunk: number;
  readonly count: number;
  /** The batch-wide index of the chunk's first item. */
  readonly firstIndex: number;
  readonly sealed: Buffer;
  /** The buffer `sealed` is a view of: once the chunk is stored it holds another chunk. */
  readonly storage: Buffer;
}

/** Whether `addPlainLines` can run here (the native kernel is built). */
export const canPackLines = nativeKernel !== undefined;
const PACK_STATE = new Uint32Array(8);
const PACK_SLOW_LINE = 1;

export interface IntakeOptions {
  readonly chunkItems: number;
  /**
   * A chunk also closes once its packed items reach this many bytes (CHUNK_BYTES), so that a
   * chunk of large items stays a Redis value and a worker's memory of a sensible size. It may
   * pass it by one item.
   */
  readonly chunkBytes: number;
  /** The largest item accepted (see itemLimit); larger ones fail alone as KF_ITEM_TOO_LARGE. */
  readonly maxItemBytes: number;
  /** Items the batch may hold; one more fails the upload with KF_BATCH_TOO_LARGE. */
  readonly maxItems: number;
  /** Called every few seconds while the body is still arriving (renews claims tied to the upload). */
  readonly keepAlive?: () => void;
}



/**
 * Turns a stream of items into stored, queued chunks. Parsers call `add`/`reject` synchronously;
 * the upload loop awaits `drain()` between body pieces, so what is held in memory is a body
 * piece and the chunks it filled, whatever the size of the batch.
 */
export class BatchIntake {
  readonly #store: BatchStore;
  readonly #queue: Queue<ChunkJobData>;
  readonly #spec: BatchSpec;
  readonly #options: IntakeOptions;
  readonly #packer = new ChunkPacker();
  /** Chunks sealed and waiting for their write (drain keeps MAX_IN_FLIGHT writes going). */
  readonly #full: SealedChunk[] = [];
  /**
   * Buffers of chunks already stored, to seal the next chunks into: the sealed copy of each
   * chunk, the one that waits for its write, reuses a few buffers instead of a new one per
   * chunk (fewer buffers awaiting collection: bench, API peak RSS).
   */
  readonly #spare: Buffer[] = [];
  #chunks = 0;
  #total = 0;
  #sealedItems = 0;
  /** The batch's context as its jobs carry it, sealed once. */
  #sealedContext: string | undefined;
  readonly #inFlight: Array<Promise<void>> = [];
  #aliveAt = Date.now();
  readonly batchId: string;

  constructor(batchId: string, spec: BatchSpec, store: BatchStore, queue: Queue<ChunkJobData>, options: IntakeOptions) {
    this.batchId = batchId;
    this.#spec = spec;
    this.#store = store;
    this.#queue = queue;
    this.#options = options;
  }

  get total(): number {
    return this.#total;
  }

  /** Adds an item given as the UTF-8 bytes of its string. */
  add(bytes: Buffer): void {
    if (bytes.length > this.#options.maxItemBytes) this.#packer.addRejected(ITEM_TOO_LARGE);
    else this.#packer.add(bytes);
    this.#counted();
  }

  /** Adds `source[start, end)` (the UTF-8 bytes of a string) as one item, copied into the chunk. */
  addRange(source: Buffer, start: number, end: number): void {
    if (end - start > this.#options.maxItemBytes) this.#packer.addRejected(ITEM_TOO_LARGE);
    else this.#packer.addRange(source, start, end);
    this.#counted();
  }

  /**
   * Packs the lines of `source[start, end)` (each ending in a newline) with the native packer,
   * for as long as they are plain ASCII JSON strings or blank, filling chunks as it goes.
   * Returns where it stopped: `end`, or the start of a line left to the caller's parser.
   * Only where the native kernel is built (`canPackLines`).
   */
  addPlainLines(source: Buffer, start: number, end: number): number {
    const state = PACK_STATE;
    let at = start;
    while (at < end) {
      const room = Math.min(this.#options.chunkItems - this.#packer.count, this.#options.maxItems + 1 - this.#total);
      const stop = this.#byteBound(source, at, end);
      // Each line of n bytes packs into at most 5 + (n - 3) bytes: 2 × the span always fits.
      const { buffer, at: outAt } = this.#packer.writable(2 * (stop - at));
      state[0] = at;
      state[1] = stop;
      state[2] = outAt;
      state[3] = room;
      state[4] = this.#options.maxItemBytes;
      nativeKernel!.packLines(source, buffer, state);
      const items = state[5]!;
      this.#packer.wrote(state[2]!, items);
      at = state[6]!;
      this.#total += items - 1;
      this.#counted(); // the batch limit, and a full chunk set aside
      if (state[7] === PACK_SLOW_LINE) return at;
    }
    return at;
  }

  /**
   * Where a run of lines from `at` should stop so that the chunk stays within CHUNK_BYTES: the
   * end of the last whole line that surely fits, or of the first line when none does (a chunk
   * then passes the limit by that one item). A line of n ≥ 3 bytes packs into at most 5n/3.
   */
  #byteBound(source: Buffer, at: number, end: number): number {
    const budget = Math.floor(((this.#options.chunkBytes - this.#packer.bytes) * 3) / 5);
    if (end - at <= budget) return end;
    const last = budget > 0 ? source.lastIndexOf(10, at + budget - 1) : -1;
    if (last >= at) return last + 1;
    const first = source.indexOf(10, at);
    return first === -1 || first >= end ? end : first + 1;
  }

  /** Adds an item that is not a JSON string (a line that is not JSON, or JSON of another type); it fails alone, in its place. */
  rejectNotString(): void {
    this.#packer.addRejected(ITEM_NOT_STRING);
    this.#counted();
  }

  rejectTooLarge(): void {
    this.#packer.addRejected(ITEM_TOO_LARGE);
    this.#counted();
  }

  /**
   * Stores and enqueues every full chunk. Up to MAX_IN_FLIGHT chunks are written at once, so
   * parsing the next chunk overlaps the Redis round trips of the last ones.
   */
  async drain(): Promise<void> {
    while (this.#full.length > 0) {
      const write = this.#enqueue(this.#full.shift()!);
      write.catch(() => {}); // awaited below or in finish(); this only keeps it from being "unhandled"
      this.#inFlight.push(write);
      if (this.#inFlight.length >= MAX_IN_FLIGHT) await this.#inFlight.shift();
    }
    const now = Date.now();
    if (now - this.#aliveAt >= this.#store.keepAliveMs) {
      this.#aliveAt = now;
      this.#store.touchUpload(this.batchId).catch(() => {}); // a lapse shows up as an abandoned upload
      this.#options.keepAlive?.();
    }
    // Readers call this after every body piece. When the body is already buffered, `for await`
    // would go on in microtasks without ever returning to the event loop; yielding here lets
    // the sync path's requests in between pieces (bench: isolation).
    await setImmediate();
  }

  /**
   * Flushes the last partial chunk, waits for every write, and seals the batch: it can now
   * complete, and has if every chunk already ran (`completed`). Refused (KF_UPLOAD_ABORTED)
   * when the batch ended meanwhile.
   */
  async finish(): Promise<'progress' | 'completed'> {
    await this.drain();
    if (this.#packer.count > 0) this.#inFlight.push(this.#enqueue(this.#sealChunk()));
    const writes = this.#inFlight.splice(0);
    await Promise.all(writes);
    return this.#store.seal(this.batchId);
  }

  #counted(): void {
    if (++this.#total > this.#options.maxItems) {
      throw new KeyfleetError('KF_BATCH_TOO_LARGE', `the batch holds more than MAX_BATCH_ITEMS (${this.#options.maxItems}) items`);
    }
    if (this.#packer.count >= this.#options.chunkItems || this.#packer.bytes >= this.#options.chunkBytes) this.#full.push(this.#sealChunk());
  }

  /** Seals the packer's items as the next chunk, straight from its buffer (no copy of the plain inputs). */
  #sealChunk(): SealedChunk {
    const chunk = this.#chunks++;
    const count = this.#packer.count;
    const firstIndex = this.#sealedItems;
    this.#sealedItems += count;
    const storage = this.#bufferFor(this.#packer.bytes + SEAL_OVERHEAD);
    const sealed = this.#packer.takeView((packed) => storage.subarray(0, this.#store.sealInputInto(this.batchId, this.#spec.tenant, chunk, packed, storage)));
    return { chunk, count, firstIndex, sealed, storage };
  }

  /** A spare buffer of at least `bytes`, else a new one with room for a chunk of longer items. */
  #bufferFor(bytes: number): Buffer {
    const spare = this.#spare.pop();
    return spare && spare.length >= bytes ? spare : Buffer.allocUnsafe(Math.ceil(bytes * 1.25));
  }

  async #enqueue({ chunk, count, firstIndex, sealed, storage }: SealedChunk): Promise<void> {
    await this.#store.addSealedChunk(this.batchId, chunk, sealed, count, firstIndex);
    // Redis has answered, so the command has been written out: the buffer is free again.
    if (this.#spare.length < MAX_IN_FLIGHT) this.#spare.push(storage);
    const { tenant, op, key, encoding, requestId, context, targetKey } = this.#spec;
    if (context !== undefined) this.#sealedContext ??= this.#store.sealContext(this.batchId, tenant, context);
    const data: ChunkJobData = {
      batchId: this.batchId, tenant, chunk, firstIndex, count, op, key, encoding, resultFormat: 'records', sealedFor: 'tenant',
      ...(requestId ? { requestId } : {}), ...(this.#sealedContext !== undefined ? { sealedContext: this.#sealedContext, context: '' } : {}), ...(targetKey ? { targetKey } : {}),
    };
    await this.#queue.add(CHUNK_JOB, data, { jobId: chunkJobId(this.batchId, chunk) });
  }
}
