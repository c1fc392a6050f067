import { isUtf8 } from 'node:buffer';
import { createReadStream } from 'node:fs';
import type { Readable } from 'node:stream';
import { truncate } from 'node:fs/promises';

/**
 * The input path that names standard input (`--in -`). Read as a stream, not as /dev/stdin,
 * which cannot be opened when stdin is a socket (as a parent process's pipe often is).
 */
export const STDIN = '-';

/** How an input is named in messages. */
export const inputName = (path: string): string => (path === STDIN ? 'stdin' : path);

/**
 * The lines of a text file (or of stdin, for STDIN) as they are read, without their line breaks
 * (a `\r` before a `\n` is kept: it belongs to the line, so a round trip gives the file back
 * byte for byte, byte order mark included), and READ_END after each read's lines. A last line
 * without a final newline counts as a line. A line that is not UTF-8 fails the read, naming it:
 * decoded with replacement characters, it would have been encrypted as other text than the
 * file holds.
 */
export async function* readLines(path: string, onBytes?: (bytesRead: number) => void): AsyncGenerator<string | typeof READ_END> {
  const source = path === STDIN ? process.stdin : createReadStream(path, { highWaterMark: 256 * 1024 });
  reading.add(source);
  try {
    yield* linesOf(source, path, onBytes);
  } finally {
    reading.delete(source);
  }
}

/**
 * Inputs being read. A run that ends before its input does (an upload the service refused at
 * its first bytes) closes them with closeInputs: a read left waiting on stdin or a pipe whose
 * writer goes on would keep the process from exiting until the writer stops.
 */
const reading = new Set<Readable>();

/**
 * Closes every input still being read (see `reading`); how many there were. A named pipe's
 * read waits in a thread of libuv's pool, which closing does not end: the caller exits.
 */
export function closeInputs(): number {
  const open = reading.size;
  for (const source of reading) source.destroy();
  reading.clear();
  return open;
}

/**
 * Yielded by readLines after the lines of each read: what came so far is all there is for now.
 * A pipe's writer may be slow; what it wrote can go on before it writes more.
 */
export const READ_END = Symbol('read end');

async function* linesOf(source: Readable, path: string, onBytes?: (bytesRead: number) => void): AsyncGenerator<string | typeof READ_END> {
  let carry: Buffer[] = []; // the bytes of a line not ended yet, joined once it ends
  let bytesRead = 0;
  let lineNo = 0;
  for await (const read of source) {
    const piece = read as Buffer;
    bytesRead += piece.length;
    onBytes?.(bytesRead);
    // A newline byte is never part of another UTF-8 character, so whole lines decode alone.
    const lastBreak = piece.lastIndexOf(10);
    if (lastBreak === -1) {
      carry.push(piece);
      yield READ_END;
      continue;
    }
    const whole = carry.length ? Buffer.concat([...carry, piece.subarray(0, lastBreak + 1)]) : piece.subarray(0, lastBreak + 1);
    carry = lastBreak + 1 < piece.length ? [piece.subarray(lastBreak + 1)] : [];
    const text = decodeLines(whole, path, lineNo);
    for (let start = 0, at = text.indexOf('\n'); at !== -1; start = at + 1, at = text.indexOf('\n', start)) {
      lineNo++;
      yield text.slice(start, at);
    }
    yield READ_END;
  }
  if (carry.length) yield decodeLines(Buffer.concat(carry), path, lineNo);
}

/** A line of an input file that is not UTF-8 text. */
export class NotUtf8Error extends Error {
  constructor(
    readonly path: string,
    readonly line: number,
  ) {
    super(`line ${line} of ${path} is not UTF-8 text`);
  }
}

/** `bytes` (whole lines) as text; a line that is not UTF-8 is named (`before`: the lines before these). */
function decodeLines(bytes: Buffer, path: string, before: number): string {
  if (isUtf8(bytes)) return bytes.toString('utf8');
  let line = before + 1;
  for (let start = 0; start < bytes.length; line++) {
    const end = bytes.indexOf(10, start);
    const stop = end === -1 ? bytes.length : end;
    if (!isUtf8(bytes.subarray(start, stop))) break;
    start = stop + 1;
  }
  throw new NotUtf8Error(inputName(path), line);
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
 * skip blank lines (the API does too), so their numbers are recorded as they are read, and the
 * output keeps a blank line where the input had one: output line n answers input line n.
 */
export class LineMap {
  /** Allocated only once an item is off its line number: a plain file costs nothing. */
  #lines: Uint32Array | undefined;
  #count = 0;
  /** The input's lines, blank ones included, once it has been read to its end (0 until then). */
  total = 0;

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
    this.total = 0;
  }

  /** How many items lie on lines 1 to `line`: where a download resumes after `line` output lines. */
  itemsThrough(line: number): number {
    if (!this.#lines) return this.total > 0 ? Math.min(line, this.#count) : line;
    let [low, high] = [0, this.#count]; // the first item past `line` lies in [low, high]
    while (low < high) {
      const mid = (low + high) >>> 1;
      if (this.#lines[mid]! <= line) low = mid + 1;
      else high = mid;
    }
    return low;
  }

  /** The 1-based line of item `index` (0-based). */
  lineOf(index: number): number {
    return this.#lines && index < this.#count ? this.#lines[index]! : index + 1;
  }
}
