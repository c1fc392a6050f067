import { isUtf8 } from 'node:buffer';
import { canPackLines, type BatchIntake } from './batch-intake.js';

const NL = 0x0a;
const CR = 0x0d;
const QUOTE = 0x22;
const BACKSLASH = 0x5c;

/**
 * Feeds NDJSON (one JSON string per line) into an intake as it streams in. A line that is a
 * plain JSON string (no escapes, no control characters) is copied as its bytes straight into
 * the chunk — no decode, no JSON.parse, no per-line allocation; where the native kernel is
 * built, runs of plain ASCII lines are packed by it in one call per piece. Anything else goes
 * through JSON.parse. A line that is not a string, or not UTF-8, or not well-formed text (a
 * lone surrogate), fails that item only. A line longer than `maxLineBytes` is skipped up to its
 * newline and fails as too large. A byte order mark at the start (files saved by Windows tools)
 * is not part of the first line.
 */
export async function readNdjsonItems(body: AsyncIterable<Buffer>, intake: BatchIntake, maxLineBytes: number, { native = canPackLines } = {}): Promise<void> {
  // The line begun in earlier pieces, as copies of its parts, joined once when it ends: joined
  // again with every piece, a line of n pieces was copied up to n times (a 60 MB line: 19 s).
  const carry: Buffer[] = [];
  let carried = 0;
  let skipping = false;
  for await (const piece of withoutByteOrderMark(body)) {
    let start = 0;
    const first = piece.indexOf(NL);
    // The line begun in an earlier piece ends at this piece's first newline.
    if (first !== -1 && (skipping || carried > 0)) {
      if (skipping) {
        skipping = false;
      } else if (carried + first > maxLineBytes) {
        intake.rejectTooLarge();
      } else {
        carry.push(piece.subarray(0, first));
        const line = Buffer.concat(carry, carried + first);
        takeLine(line, 0, line.length, intake);
      }
      carry.length = 0;
      carried = 0;
      start = first + 1;
    }
    const last = piece.lastIndexOf(NL);
    while (start <= last) {
      if (native) {
        start = intake.addPlainLines(piece, start, last + 1);
        if (start > last) break;
      }
      const at = piece.indexOf(NL, start);
      takeLine(piece, start, at, intake);
      start = at + 1;
    }
    if (start < piece.length && !skipping) {
      // Copy: the rest of this piece outlives it.
      carry.push(Buffer.from(piece.subarray(start)));
      carried += piece.length - start;
      if (carried > maxLineBytes) {
        carry.length = 0;
        carried = 0;
        skipping = true;
        intake.rejectTooLarge();
      }
    }
    await intake.drain();
  }
  if (carried > 0 && !skipping) {
    const line = Buffer.concat(carry, carried);
    takeLine(line, 0, line.length, intake);
  }
}

/** Takes the line `buf[start, end)`. */
function takeLine(buf: Buffer, start: number, end: number, intake: BatchIntake): void {
  if (end > start && buf[end - 1] === CR) end--;
  while (start < end && (buf[start] === 0x20 || buf[start] === 0x09)) start++;
  while (end > start && (buf[end - 1] === 0x20 || buf[end - 1] === 0x09)) end--;
  if (start === end) return; // a blank line is no item
  if (end - start >= 2 && buf[start] === QUOTE && buf[end - 1] === QUOTE) {
    let plain = true;
    let ascii = true;
    for (let i = start + 1; i < end - 1; i++) {
      const b = buf[i]!;
      if (b === QUOTE || b === BACKSLASH || b < 0x20) {
        plain = false;
        break;
      }
      if (b >= 0x80) ascii = false;
    }
    if (plain) {
      if (ascii || isUtf8(buf.subarray(start + 1, end - 1))) intake.addRange(buf, start + 1, end - 1);
      else intake.rejectNotString();
      return;
    }
  }
  // Decoding turns bytes that are not UTF-8 into U+FFFD, and encoding a lone surrogate (an
  // escape such as \ud800) does too: either way other text than was sent. Such a line fails as
  // a plain line with such bytes does. The bytes are checked only where U+FFFD shows up.
  const text = buf.toString('utf8', start, end);
  let value: unknown;
  try {
    value = text.includes('\ufffd') && !isUtf8(buf.subarray(start, end)) ? undefined : JSON.parse(text);
  } catch {
    value = undefined;
  }
  if (typeof value === 'string' && value.isWellFormed()) intake.add(Buffer.from(value, 'utf8'));
  else intake.rejectNotString();
}

const BOM = Buffer.from([0xef, 0xbb, 0xbf]);

/** The body without a UTF-8 byte order mark at its start, however the first pieces are cut. */
async function* withoutByteOrderMark(body: AsyncIterable<Buffer>): AsyncGenerator<Buffer> {
  let head: Buffer | undefined = Buffer.alloc(0); // the first bytes, until they tell; then undefined
  for await (const piece of body) {
    if (!head) {
      yield piece;
      continue;
    }
    head = head.length === 0 ? piece : Buffer.concat([head, piece]);
    if (head.length < BOM.length && BOM.subarray(0, head.length).equals(head)) continue;
    yield BOM.equals(head.subarray(0, BOM.length)) ? head.subarray(BOM.length) : head;
    head = undefined;
  }
  if (head?.length) yield head;
}
