import { isUtf8 } from 'node:buffer';
import type { BatchIntake } from './batch-intake.js';

const NL = 0x0a;
const CR = 0x0d;
const QUOTE = 0x22;
const BACKSLASH = 0x5c;

/**
 * Feeds NDJSON (one JSON string per line) into an intake as it streams in. A line that is a
 * plain JSON string without escapes is taken as its bytes directly (no decode, no JSON.parse);
 * anything else goes through JSON.parse. A line that is not a string fails that item only.
 * A line longer than `maxLineBytes` is skipped up to its newline and fails as too large.
 */
export async function readNdjsonItems(body: AsyncIterable<Buffer>, intake: BatchIntake, maxLineBytes: number): Promise<void> {
  let carry: Buffer | undefined;
  let skipping = false;
  for await (const piece of body) {
    let start = 0;
    let at = piece.indexOf(NL, start);
    while (at !== -1) {
      if (skipping) {
        skipping = false;
      } else if (carry) {
        const line = Buffer.concat([carry, piece.subarray(start, at)]);
        carry = undefined;
        if (line.length > maxLineBytes) intake.rejectTooLarge();
        else takeLine(line, intake);
      } else {
        takeLine(piece.subarray(start, at), intake);
      }
      start = at + 1;
      at = piece.indexOf(NL, start);
    }
    if (start < piece.length && !skipping) {
      // Copy: the rest of this piece outlives it.
      carry = carry ? Buffer.concat([carry, piece.subarray(start)]) : Buffer.from(piece.subarray(start));
      if (carry.length > maxLineBytes) {
        carry = undefined;
        skipping = true;
        intake.rejectTooLarge();
      }
    }
    await intake.drain();
  }
  if (carry && !skipping) takeLine(carry, intake);
}

function takeLine(raw: Buffer, intake: BatchIntake): void {
  const line = raw.length > 0 && raw[raw.length - 1] === CR ? raw.subarray(0, raw.length - 1) : raw;
  if (line.length === 0 || isBlank(line)) return;
  if (line.length >= 2 && line[0] === QUOTE && line[line.length - 1] === QUOTE) {
    const inner = line.subarray(1, line.length - 1);
    if (isPlain(inner)) {
      if (isUtf8(inner)) intake.add(inner);
      else intake.rejectNotString();
      return;
    }
  }
  let value: unknown;
  try {
    value = JSON.parse(line.toString('utf8'));
  } catch {
    intake.rejectNotString();
    return;
  }
  if (typeof value === 'string') intake.add(Buffer.from(value, 'utf8'));
  else intake.rejectNotString();
}

/** True when the bytes hold no quote, backslash or control character: the JSON string is its own content. */
function isPlain(bytes: Buffer): boolean {
  for (let i = 0; i < bytes.length; i++) {
    const b = bytes[i]!;
    if (b === QUOTE || b === BACKSLASH || b < 0x20) return false;
  }
  return true;
}

function isBlank(bytes: Buffer): boolean {
  for (let i = 0; i < bytes.length; i++) {
    const b = bytes[i]!;
    if (b !== 0x20 && b !== 0x09) return false;
  }
  return true;
}
