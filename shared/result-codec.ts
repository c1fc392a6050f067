import { formatCiphertext } from './crypto/format.js';
import { CATALOGUE, type ErrorCode } from './errors.js';

/**
 * A chunk's results as the worker stores them: the format byte, then per item one record
 * [u8 kind][u32le length][payload], in input order:
 * - CIPHERTEXT: [u32le key version][nonce ‖ ciphertext ‖ tag]
 * - PLAINTEXT_UTF8 / PLAINTEXT_BASE64: the plaintext's bytes (UTF-8 already checked)
 * - ERROR: [u8 index into RESULT_ERRORS]
 * The API turns records into NDJSON result lines as it streams them (`formatResults`): raw
 * bytes are about 60% of the lines' size, so Redis, the at-rest seal and the sockets between
 * carry that much less. Results stored as lines by an earlier version start with `{` and pass
 * through as they are.
 */
export const RESULTS_FORMAT = 1;
export const RECORD_CIPHERTEXT = 0;
export const RECORD_PLAINTEXT_UTF8 = 1;
export const RECORD_PLAINTEXT_BASE64 = 2;
export const RECORD_ERROR = 3;
export type RecordKind = typeof RECORD_CIPHERTEXT | typeof RECORD_PLAINTEXT_UTF8 | typeof RECORD_PLAINTEXT_BASE64 | typeof RECORD_ERROR;

const HEADER = 5;
const LINES_FORMAT = 0x7b; // '{': the first byte of stored NDJSON lines

/** The item-level codes a record can carry, in the order the native kernel indexes them. */
export const RESULT_ERRORS: readonly ErrorCode[] = ['KF_INVALID_ITEM', 'KF_ITEM_TOO_LARGE', 'KF_DECRYPT_FAILED', 'KF_KEY_VERSION_DISABLED', 'KF_NOT_UTF8', 'KF_INVALID_ENCODING'];
const ERROR_INDEX = new Map(RESULT_ERRORS.map((code, i) => [code, i]));
/** JSON in ASCII: every character past it escaped (\uXXXX, a surrogate pair as two). */
export const asciiJson = (value: unknown): string => JSON.stringify(value).replace(/[^\x00-\x7f]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);

/**
 * Each of those codes as the JSON of its error, as result lines carry it (the native kernel's
 * table too), in ASCII whatever a message says: an encrypt or rewrap answer, ciphertexts and
 * errors, is read as latin1 (sync-crypto.ts).
 */
export const RESULT_ERROR_JSON: readonly string[] = RESULT_ERRORS.map((code) => asciiJson({ code, message: CATALOGUE[code].message }));
const LONGEST_ERROR = Math.max(...RESULT_ERROR_JSON.map((e) => Buffer.byteLength(e)));

/** The most bytes one record's line can take: its fixed parts, then the payload as escaped JSON (≤ 6×) or base64. */
export const lineBound = (payloadBytes: number): number => 48 + LONGEST_ERROR + 6 * payloadBytes;

/** Writes a chunk's records into one growing buffer (the node:crypto kernel's output). */
export class ResultWriter {
  #buf = Buffer.allocUnsafe(16 * 1024);
  #at = 0;

  constructor() {
    this.#buf[this.#at++] = RESULTS_FORMAT;
  }

  ciphertext(version: number, sealed: Buffer): void {
    const at = this.#record(RECORD_CIPHERTEXT, 4 + sealed.length);
    this.#buf.writeUInt32LE(version, at);
    sealed.copy(this.#buf, at + 4);
  }

  plaintext(bytes: Buffer, kind: typeof RECORD_PLAINTEXT_UTF8 | typeof RECORD_PLAINTEXT_BASE64): void {
    const at = this.#record(kind, bytes.length); // first: it may replace the buffer
    bytes.copy(this.#buf, at);
  }

  error(code: ErrorCode): void {
    const index = ERROR_INDEX.get(code);
    if (index === undefined) throw new Error(`${code} is not an item-level error`);
    const at = this.#record(RECORD_ERROR, 1);
    this.#buf[at] = index;
  }

  /** The records written, as a view of the writer's buffer. */
  get bytes(): Buffer {
    return this.#buf.subarray(0, this.#at);
  }

  /** Reserves a record; returns where its payload goes. */
  #record(kind: RecordKind, length: number): number {
    if (this.#at + HEADER + length > this.#buf.length) {
      const grown = Buffer.allocUnsafe(Math.max(this.#buf.length * 2, this.#at + HEADER + length));
      this.#buf.copy(grown, 0, 0, this.#at);
      this.#buf = grown;
    }
    this.#buf[this.#at] = kind;
    this.#buf.writeUInt32LE(length, this.#at + 1);
    this.#at += HEADER + length;
    return this.#at - length;
  }
}

/** The addon's formatter (native/kernel.c), where built: [at, index, written] in `state`. */
export interface NativeFormatter {
  formatResults(records: Uint8Array, out: Uint8Array, state: Uint32Array): void;
}

/**
 * The NDJSON result lines of one chunk's stored results, from its item `skip` on, numbered from
 * `firstIndex + skip`, in pieces of about `pieceBytes`. Each piece is its own buffer.
 */
export function* resultLines(stored: Buffer, firstIndex: number, skip: number, native: NativeFormatter | undefined, pieceBytes = 256 * 1024): Generator<Buffer> {
  if (stored[0] === LINES_FORMAT) {
    let at = 0;
    for (let n = 0; n < skip && at < stored.length; n++) at = stored.indexOf(0x0a, at) + 1 || stored.length;
    if (at < stored.length) yield stored.subarray(at);
    return;
  }
  if (stored[0] !== RESULTS_FORMAT) throw new Error(`corrupt results: unknown format ${stored[0]}`);
  let at = skipRecords(stored, 1, skip);
  let index = firstIndex + skip;
  if (!native) {
    yield* formatJs(stored, at, index, pieceBytes);
    return;
  }
  const state = new Uint32Array(3);
  const piece = Buffer.allocUnsafe(pieceBytes);
  while (at < stored.length) {
    state[0] = at;
    state[1] = index;
    let out = piece;
    native.formatResults(stored, out, state);
    if (state[2] === 0) {
      // A line longer than a piece (a large plaintext) gets a buffer of its own.
      out = Buffer.allocUnsafe(lineBound(stored.readUInt32LE(at + 1)));
      native.formatResults(stored, out, state);
      if (state[2] === 0) throw new Error('formatResults wrote nothing into a buffer of its bound');
    }
    at = state[0];
    index = state[1];
    // The piece is reused: what leaves is a copy. A buffer of its own leaves as it is.
    yield out === piece ? Buffer.from(piece.subarray(0, state[2])) : out.subarray(0, state[2]);
  }
}

const NOT_PROCESSED_TAIL = `,"error":${asciiJson({ code: 'KF_ITEM_NOT_PROCESSED', message: CATALOGUE.KF_ITEM_NOT_PROCESSED.message })}}\n`;

/**
 * The lines of items `from` to `to` (not included) of a chunk that never ran, its batch having
 * failed first: each a KF_ITEM_NOT_PROCESSED error, in pieces of about `pieceBytes`.
 */
export function* notProcessedLines(from: number, to: number, pieceBytes = 256 * 1024): Generator<Buffer> {
  let out = '';
  for (let i = from; i < to; i++) {
    out += `{"i":${i}${NOT_PROCESSED_TAIL}`;
    if (out.length >= pieceBytes) {
      yield Buffer.from(out, 'latin1');
      out = '';
    }
  }
  if (out) yield Buffer.from(out, 'latin1');
}

/** The offset of record `skip` (counting from the one at `at`). */
function skipRecords(stored: Buffer, at: number, skip: number): number {
  for (let n = 0; n < skip && at < stored.length; n++) {
    if (at + HEADER > stored.length) throw new Error('corrupt results: record header truncated');
    at += HEADER + stored.readUInt32LE(at + 1);
  }
  if (at > stored.length) throw new Error('corrupt results: record truncated');
  return at;
}

/** The lines of the records from `at` on, in JavaScript, in pieces of about `pieceBytes`: the same bytes the native formatter writes. */
function* formatJs(stored: Buffer, at: number, index: number, pieceBytes: number): Generator<Buffer> {
  let out = '';
  while (at < stored.length) {
    if (at + HEADER > stored.length) throw new Error('corrupt results: record header truncated');
    const kind = stored[at]!;
    const end = at + HEADER + stored.readUInt32LE(at + 1);
    if (end > stored.length) throw new Error('corrupt results: record truncated');
    const payload = stored.subarray(at + HEADER, end);
    out += `{"i":${index},`;
    if (kind === RECORD_CIPHERTEXT && payload.length >= 4) {
      out += `"ciphertext":"${formatCiphertext(payload.readUInt32LE(0), payload.subarray(4))}"}\n`;
    } else if (kind === RECORD_PLAINTEXT_UTF8) {
      out += `"plaintext":${JSON.stringify(payload.toString('utf8'))}}\n`;
    } else if (kind === RECORD_PLAINTEXT_BASE64) {
      out += `"plaintext":"${payload.toString('base64')}"}\n`;
    } else if (kind === RECORD_ERROR && payload.length === 1 && payload[0]! < RESULT_ERROR_JSON.length) {
      out += `"error":${RESULT_ERROR_JSON[payload[0]!]}}\n`;
    } else {
      throw new Error(`corrupt results: record of kind ${kind} and ${payload.length} bytes`);
    }
    at = end;
    index++;
    if (out.length >= pieceBytes) {
      yield Buffer.from(out, 'utf8');
      out = '';
    }
  }
  if (out) yield Buffer.from(out, 'utf8');
}
