/**
 * The binary layout of a chunk's inputs, as stored in Redis and transferred to a thread:
 * a sequence of [u8 flag][u32le length][length bytes]. One buffer per chunk, so a chunk is one
 * Redis value and one zero-copy transfer, never an array of strings.
 */
export const ITEM_OK = 0;
export const ITEM_NOT_STRING = 1;
export const ITEM_TOO_LARGE = 2;
export type ItemFlag = typeof ITEM_OK | typeof ITEM_NOT_STRING | typeof ITEM_TOO_LARGE;

const HEADER = 5;

export class ChunkPacker {
  // One growing buffer per chunk: items are copied in with their header, no per-item allocation.
  #buf = Buffer.allocUnsafe(64 * 1024);
  #at = 0;
  #count = 0;

  get count(): number {
    return this.#count;
  }

  /** The bytes the items added so far take, headers included. */
  get bytes(): number {
    return this.#at;
  }

  /** Adds an item whose bytes are the UTF-8 text the caller sent. */
  add(bytes: Uint8Array): void {
    this.addRange(bytes, 0, bytes.length);
  }

  /** Adds `source[start, end)` as one item, copying it. */
  addRange(source: Uint8Array, start: number, end: number): void {
    const length = end - start;
    this.#reserve(HEADER + length);
    const buf = this.#buf;
    buf[this.#at] = ITEM_OK;
    buf.writeUInt32LE(length, this.#at + 1);
    buf.set(source.subarray(start, end), this.#at + HEADER);
    this.#at += HEADER + length;
    this.#count++;
  }

  /** Adds an item that already failed validation; the kernel reports it in place. */
  addRejected(flag: typeof ITEM_NOT_STRING | typeof ITEM_TOO_LARGE): void {
    this.#reserve(HEADER);
    this.#buf[this.#at] = flag;
    this.#buf.writeUInt32LE(0, this.#at + 1);
    this.#at += HEADER;
    this.#count++;
  }

  /**
   * Room for `bytes` more, for a writer that packs items into the buffer itself (the native
   * NDJSON packer): the buffer and the offset to write at. `wrote` then records what it wrote.
   */
  writable(bytes: number): { buffer: Buffer; at: number } {
    this.#reserve(bytes);
    return { buffer: this.#buf, at: this.#at };
  }

  /** Records `items` items written through `writable`, ending at byte `at`. */
  wrote(at: number, items: number): void {
    this.#at = at;
    this.#count += items;
  }

  /** The items added so far as one buffer (its own memory); the packer starts a new chunk. */
  take(): Buffer {
    return this.takeView((packed) => Buffer.from(packed));
  }

  /**
   * Hands the items added so far to `use` as a view of the packer's own buffer, valid only
   * during the call (`use` seals or copies it), and starts a new chunk.
   * The items may be plaintexts: the buffer is wiped after the call, not left for the next chunk.
   */
  takeView<T>(use: (packed: Buffer) => T): T {
    try {
      return use(this.#buf.subarray(0, this.#at));
    } finally {
      this.#buf.fill(0, 0, this.#at);
      this.#at = 0;
      this.#count = 0;
    }
  }

  #reserve(bytes: number): void {
    if (this.#at + bytes <= this.#buf.length) return;
    const grown = Buffer.allocUnsafe(Math.max(this.#buf.length * 2, this.#at + bytes));
    this.#buf.copy(grown, 0, 0, this.#at);
    this.#buf.fill(0, 0, this.#at); // the items it held (plaintexts) do not stay behind in memory let go
    this.#buf = grown;
  }
}

/** Calls `visit` for each packed item in order. Throws on a truncated buffer (a corrupt chunk). */
export function forEachItem(packed: Buffer, visit: (flag: ItemFlag, bytes: Buffer, index: number) => void): number {
  let at = 0;
  let index = 0;
  while (at < packed.length) {
    if (at + HEADER > packed.length) throw new Error(`corrupt chunk: header truncated at byte ${at}`);
    const flag = packed[at] as ItemFlag;
    const length = packed.readUInt32LE(at + 1);
    const end = at + HEADER + length;
    if (end > packed.length) throw new Error(`corrupt chunk: item ${index} needs ${length} bytes, ${packed.length - at - HEADER} remain`);
    visit(flag, packed.subarray(at + HEADER, end), index);
    at = end;
    index++;
  }
  return index;
}
