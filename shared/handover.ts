/**
 * A value handed over once: after `take`, the handover holds nothing.
 *
 * A promise keeps what it resolved to for as long as it lives. One that waited through a
 * young-generation collection or two is in V8's old generation by the time it resolves, and only
 * a full collection frees it, with what it holds. A download that reads the next chunk's results
 * while it sends this one makes such promises (ioredis's for the command, ours around it), and the
 * ~700 KB each held piled up between full collections: 22–43 MB more API memory per million items
 * (bench/NOTES.md, API peak RSS). Resolved with a handover the reader empties, they hold nothing.
 */
export class Handover<T> {
  #value: T | undefined;
  #taken = false;

  constructor(value: T) {
    this.#value = value;
  }

  take(): T {
    if (this.#taken) throw new Error('a handover is taken once');
    this.#taken = true;
    const value = this.#value as T;
    this.#value = undefined;
    return value;
  }
}
