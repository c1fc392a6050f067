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
  #parts: Buffer[] = [];
  #bytes = 0;
  #count = 0;

  get count(): number {
    return this.#count;
  }

  /** Adds an item whose bytes are the UTF-8 text the caller sent. */
  add(bytes: Buffer): void {
    this.#push(ITEM_OK, bytes);
  }

  /** Adds an item that already failed validation; the kernel reports it in place. */
  addRejected(flag: typeof ITEM_NOT_STRING | typeof ITEM_TOO_LARGE): void {
    this.#push(flag, EMPTY);
  }

  /** Packs the items added so far into one buffer and starts a new chunk. */
  take(): Buffer {
    const out = Buffer.allocUnsafe(this.#bytes);
    let at = 0;
    for (const part of this.#parts) at += part.copy(out, at);
    this.#parts = [];
    this.#bytes = 0;
    this.#count = 0;
    return out;
  }

  #push(flag: ItemFlag, bytes: Buffer): void {
    const header = Buffer.allocUnsafe(HEADER);
    header[0] = flag;
    header.writeUInt32LE(bytes.length, 1);
    this.#parts.push(header, bytes);
    this.#bytes += HEADER + bytes.length;
    this.#count++;
  }
}

const EMPTY = Buffer.alloc(0);

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
