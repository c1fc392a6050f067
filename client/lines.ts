import { createReadStream } from 'node:fs';
import { truncate } from 'node:fs/promises';
import { StringDecoder } from 'node:string_decoder';

/**
 * The lines of a text file as they are read, without their line breaks (a `\r` before a `\n`
 * is kept: it belongs to the line, so a round trip gives the file back byte for byte). A last
 * line without a final newline counts as a line.
 */
export async function* readLines(path: string, onBytes?: (bytesRead: number) => void): AsyncGenerator<string> {
  let carry = '';
  let bytesRead = 0;
  const decoder = new StringDecoder('utf8');
  for await (const piece of createReadStream(path, { highWaterMark: 256 * 1024 })) {
    bytesRead += (piece as Buffer).length;
    onBytes?.(bytesRead);
    const text = carry + decoder.write(piece as Buffer);
    let start = 0;
    let at: number;
    while ((at = text.indexOf('\n', start)) !== -1) {
      yield text.slice(start, at);
      start = at + 1;
    }
    carry = text.slice(start);
  }
  carry += decoder.end();
  if (carry) yield carry;
}

/**
 * How far an earlier download got: the complete lines of `path` (0 when it does not exist). A
 * line cut short by a crash is removed, so that appending goes on from a clean line break.
 */
export async function resumePoint(path: string): Promise<number> {
  let lines = 0;
  let clean = 0; // bytes up to and including the last line break
  let offset = 0;
  try {
    for await (const piece of createReadStream(path, { highWaterMark: 1024 * 1024 })) {
      const buf = piece as Buffer;
      for (let at = buf.indexOf(10); at !== -1; at = buf.indexOf(10, at + 1)) {
        lines++;
        clean = offset + at + 1;
      }
      offset += buf.length;
    }
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === 'ENOENT') return 0;
    throw err;
  }
  if (clean < offset) await truncate(path, clean);
  return lines;
}

/**
 * Item number → line number of the input. Plain files have one item per line; NDJSON files
 * skip blank lines (the API does too), so their numbers are recorded as they are read.
 */
export class LineMap {
  /** Allocated only once an item is off its line number: a plain file costs nothing. */
  #lines: Uint32Array | undefined;
  #count = 0;

  /** Records that the next item is on `line` (1-based). */
  push(line: number): void {
    if (!this.#lines) {
      if (line === this.#count + 1) {
        this.#count++;
        return;
      }
      this.#lines = new Uint32Array(Math.max(1024, 2 * this.#count));
      for (let i = 0; i < this.#count; i++) this.#lines[i] = i + 1;
    }
    if (this.#count === this.#lines.length) {
      const grown = new Uint32Array(this.#lines.length * 2);
      grown.set(this.#lines);
      this.#lines = grown;
    }
    this.#lines[this.#count++] = line;
  }

  reset(): void {
    this.#lines = undefined;
    this.#count = 0;
  }

  /** The 1-based line of item `index` (0-based). */
  lineOf(index: number): number {
    return this.#lines && index < this.#count ? this.#lines[index]! : index + 1;
  }
}
