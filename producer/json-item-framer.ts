import { isUtf8 } from 'node:buffer';
import { KeyfleetError } from '../shared/errors.js';

const QUOTE = 0x22;
const BACKSLASH = 0x5c;
const COMMA = 0x2c;
const COLON = 0x3a;
const OPEN_BRACE = 0x7b;
const CLOSE_BRACE = 0x7d;
const OPEN_BRACKET = 0x5b;
const CLOSE_BRACKET = 0x5d;
/** A key longer than this (raw) cannot be "items", however it is escaped. */
const KEY_BYTES = 64;

/** Where the framer is: between tokens, inside a string or number/literal outside the items, or inside an element of "items". */
const BETWEEN = 0;
const STRING = 1;
const WORD = 2;
const ELEMENT = 3;
/** `closingQuote`: the piece ends inside a string, just after a backslash. */
const ENDS_ESCAPED = -2;

const isSpace = (b: number): boolean => b === 0x20 || b === 0x0a || b === 0x0d || b === 0x09;
const endsWord = (b: number): boolean => isSpace(b) || b === COMMA || b === COLON || b === QUOTE || b === OPEN_BRACE || b === CLOSE_BRACE || b === OPEN_BRACKET || b === CLOSE_BRACKET;

/** Why an element is not passed on: longer than the limit, or not UTF-8 (the parser would fail the whole body on it). */
export type Skipped = 'too-large' | 'not-utf8';

/**
 * Splits the body into what the parser may see at once. Tracks only what it must: nesting,
 * strings, the key of each member of the top-level object, and where each element of an
 * "items" array starts and ends; the parser still checks everything. An element is passed on
 * when it ends (from the body piece itself, or from copies if it spans pieces); one that grows
 * past the limit, or whose bytes are not UTF-8, is never passed on: `skip` stands in for it, once.
 */
export class ItemFramer {
  readonly #max: number;
  readonly #write: (bytes: Uint8Array) => void;
  readonly #skip: (why: Skipped) => void;
  /** Body bytes before the current piece. */
  #base = 0;
  #state = BETWEEN;
  /** Where the current string, word or element started, in body bytes. */
  #start = 0;
  #escaped = false;
  #depth = 0;
  #topIsObject = false;
  /** Directly inside an "items" array of the top-level object. */
  #inItems = false;
  /** The next string in the top-level object is a member's key. */
  #keyNext = false;
  /** The key being read (its first KEY_BYTES bytes), while in a key. */
  #key: number[] | undefined;
  #itemsKey = false;
  #sawItems = false;
  /** The element being read: its nesting, whether it is in a string, whether it is a bare word. */
  #elementDepth = 0;
  #elementInString = false;
  #elementIsWord = false;
  /** Copies of the element's bytes from earlier pieces. */
  #held: Buffer[] = [];
  #oversized = false;
  /** From here on the current piece is UTF-8, up to a character its end may cut (Infinity: it is not). */
  #utf8From = 0;

  constructor(max: number, write: (bytes: Uint8Array) => void, skip: (why: Skipped) => void) {
    this.#max = max;
    this.#write = write;
    this.#skip = skip;
  }

  push(piece: Buffer): void {
    const n = piece.length;
    // One check of the piece spares one per element: only one that starts before the checked
    // bytes, or in a piece that fails the check, is checked alone.
    this.#utf8From = utf8From(piece);
    let from = 0; // bytes of this piece before `from` are passed on (or skipped)
    for (let i = 0; i < n; i++) {
      const b = piece[i]!;
      switch (this.#state) {
        case STRING: {
          const end = this.#key ? this.#keyEnd(piece, i) : this.#stringEnd(piece, i);
          if (end === -1) {
            i = n;
            break;
          }
          this.#endToken(this.#base + end + 1);
          i = end;
          break;
        }
        case WORD:
          if (endsWord(b)) {
            this.#endToken(this.#base + i);
            i--; // the byte after a word is read as the next token
          }
          break;
        case ELEMENT: {
          const end = this.#elementEnd(piece, i);
          if (end === -1) {
            i = n;
            break;
          }
          from = this.#endElement(piece, from, end);
          i = end - 1;
          break;
        }
        default:
          this.#between(b, this.#base + i);
      }
    }
    if (this.#state !== ELEMENT) {
      if (this.#state !== BETWEEN) this.#checkToken(this.#base + n);
      this.#write(piece.subarray(from));
    } else if (!this.#oversized) {
      // The element goes on in the next piece: what is before it is passed on, it is held.
      const start = Math.max(from, this.#start - this.#base);
      this.#write(piece.subarray(from, start));
      if (this.#base + n - this.#start > this.#max) this.#giveUp();
      else this.#held.push(Buffer.from(piece.subarray(start))); // copied: the piece is not ours to keep
    }
    this.#base += n;
  }

  /** The body has ended: an element cut short goes to the parser, which reports the JSON as incomplete. */
  end(): void {
    if (this.#state === ELEMENT && !this.#oversized) for (const part of this.#held.splice(0)) this.#write(part);
  }

  /** A byte between tokens, at body offset `at`. */
  #between(b: number, at: number): void {
    if (isSpace(b) || b === COLON) return;
    const itemsKey = this.#itemsKey;
    this.#itemsKey = false;
    if (this.#inItems && b !== COMMA && b !== CLOSE_BRACKET && b !== CLOSE_BRACE) {
      this.#state = ELEMENT;
      this.#start = at;
      this.#elementDepth = b === OPEN_BRACE || b === OPEN_BRACKET ? 1 : 0;
      this.#elementInString = b === QUOTE;
      this.#elementIsWord = this.#elementDepth === 0 && !this.#elementInString;
      this.#escaped = false;
      return;
    }
    // The body is an object, and the value of its "items" an array: a string, number or literal
    // there is not the shape (read on, it would pass as an upload of no items).
    if ((this.#depth === 0 && b !== OPEN_BRACE) || (itemsKey && b !== OPEN_BRACKET)) throw notTheShape();
    switch (b) {
      case OPEN_BRACE:
      case OPEN_BRACKET:
        if (this.#depth === 0) this.#topIsObject = b === OPEN_BRACE;
        // The body is {"items": [...]} and nothing else, so nothing nests deeper outside an
        // element (the parser's cost per closed value grows with the depth it holds).
        if (this.#depth === 0 ? b !== OPEN_BRACE : this.#depth > 1 || b !== OPEN_BRACKET || !itemsKey) throw notTheShape();
        this.#inItems = this.#depth === 1 && this.#topIsObject && b === OPEN_BRACKET && itemsKey;
        this.#keyNext = this.#depth === 0 && this.#topIsObject;
        this.#depth++;
        return;
      case CLOSE_BRACE:
      case CLOSE_BRACKET:
        this.#inItems = false;
        this.#depth--;
        return;
      case COMMA:
        if (this.#depth === 1 && this.#topIsObject) this.#keyNext = true;
        return;
      case QUOTE:
        this.#key = this.#depth === 1 && this.#topIsObject && this.#keyNext ? [] : undefined;
        this.#keyNext = false;
        this.#escaped = false;
        this.#state = STRING;
        this.#start = at;
        return;
      default:
        this.#state = WORD;
        this.#start = at;
    }
  }

  /** The string or word outside the items ends before body offset `end`. */
  #endToken(end: number): void {
    this.#checkToken(end);
    if (this.#key) {
      const raw = this.#key;
      this.#key = undefined;
      const key = raw.length <= KEY_BYTES ? keyOf(raw) : undefined;
      if (key !== 'items') {
        const shown = key ?? `${Buffer.from(raw).toString('utf8')}…`;
        throw new KeyfleetError('KF_VALIDATION', `body: unrecognized key ${JSON.stringify(shown)}: a batch's body holds "items" only; its options (encoding, context, callbackUrl …) go in the query string`);
      }
      if (this.#sawItems) throw new KeyfleetError('KF_VALIDATION', 'body: "items" given twice');
      this.#sawItems = this.#itemsKey = true;
    }
    this.#state = BETWEEN;
  }

  #checkToken(end: number): void {
    if (end - this.#start > this.#max) {
      throw new KeyfleetError('KF_PAYLOAD_TOO_LARGE', `a string or number outside "items" is longer than ${this.#max} bytes`);
    }
  }

  /** Where in `piece` the element ends (exclusive), from `i` on; -1 if not in this piece. */
  #elementEnd(piece: Buffer, i: number): number {
    const n = piece.length;
    if (this.#elementIsWord) {
      for (; i < n; i++) if (endsWord(piece[i]!)) return i;
      return -1;
    }
    while (i < n) {
      if (this.#elementInString) {
        const quote = this.#stringEnd(piece, i);
        if (quote === -1) return -1;
        this.#elementInString = false;
        if (this.#elementDepth === 0) return quote + 1;
        i = quote + 1;
        continue;
      }
      const c = piece[i]!;
      if (c === QUOTE) this.#elementInString = true;
      else if (c === OPEN_BRACE || c === OPEN_BRACKET) this.#elementDepth++;
      else if ((c === CLOSE_BRACE || c === CLOSE_BRACKET) && --this.#elementDepth === 0) return i + 1;
      i++;
    }
    return -1;
  }

  /** Reads on in a string from `i`: the index of its closing quote, or -1 if it goes on past this piece. */
  #stringEnd(piece: Buffer, i: number): number {
    if (this.#escaped) {
      if (i >= piece.length) return -1;
      this.#escaped = false;
      i++; // the escaped byte
    }
    const quote = closingQuote(piece, i);
    this.#escaped = quote === ENDS_ESCAPED;
    return quote < 0 ? -1 : quote;
  }

  /** `#stringEnd` for a key of the top-level object, keeping its first bytes. */
  #keyEnd(piece: Buffer, i: number): number {
    const key = this.#key!;
    for (; i < piece.length; i++) {
      const c = piece[i]!;
      if (key.length <= KEY_BYTES) key.push(c);
      if (this.#escaped) this.#escaped = false;
      else if (c === BACKSLASH) this.#escaped = true;
      else if (c === QUOTE) return i;
    }
    return -1;
  }

  /** The element is too large: what was held of it is dropped, and the parser is given its stand-in. */
  #giveUp(): void {
    this.#held = [];
    this.#oversized = true;
    this.#skip('too-large');
  }

  /** The element ends at `end` in `piece`; returns where the piece's bytes to pass on now start. */
  #endElement(piece: Buffer, from: number, end: number): number {
    this.#state = BETWEEN;
    if (this.#oversized) {
      this.#oversized = false;
      return end;
    }
    const start = this.#start - this.#base; // negative when it began in an earlier piece
    const skipped: Skipped | undefined =
      this.#base + end - this.#start > this.#max ? 'too-large'
      : !this.#isUtf8(piece, start, end) ? 'not-utf8'
      : undefined;
    if (skipped) {
      this.#write(piece.subarray(from, Math.max(from, start)));
      this.#held = [];
      this.#skip(skipped);
      return end;
    }
    // Begun in an earlier piece: what was held goes first, then this piece from its start.
    for (const part of this.#held.splice(0)) this.#write(part);
    return from;
  }

  /** Whether the element that ends at `end` of `piece` (and starts at `start`, or in the held copies) is UTF-8. */
  #isUtf8(piece: Buffer, start: number, end: number): boolean {
    if (start >= 0) return start >= this.#utf8From || isUtf8(piece.subarray(start, end));
    // Its parts may cut a character in two: checked joined (an element is at most the limit).
    return isUtf8(Buffer.concat([...this.#held, piece.subarray(0, end)]));
  }
}

/**
 * The index of the quote that closes a string whose contents go on at `from` (not just after a
 * backslash): a quote after an even run of backslashes. -1 if the piece ends first, ENDS_ESCAPED
 * if it ends just after a backslash. indexOf finds quotes at memchr speed: items are mostly long
 * runs of plain bytes.
 */
function closingQuote(piece: Buffer, from: number): number {
  for (let at = from; ; ) {
    const quote = piece.indexOf(QUOTE, at);
    const end = quote === -1 ? piece.length : quote;
    let run = 0;
    while (end - run > from && piece[end - run - 1] === BACKSLASH) run++;
    if (quote === -1) return run % 2 === 1 ? ENDS_ESCAPED : -1;
    if (run % 2 === 0) return quote;
    at = quote + 1;
  }
}

/**
 * Where `piece` is UTF-8 from, up to its last bytes: Infinity if it is not. A character cut by the
 * piece boundary is not UTF-8 on its own, so up to 3 bytes that are not ASCII are left out at
 * either edge. Those at the end belong to a token that goes on in the next piece, as an element
 * within the piece ends with an ASCII byte (a quote, a bracket) or before one (a number).
 */
function utf8From(piece: Buffer): number {
  let start = 0;
  let end = piece.length;
  while (start < 3 && start < end && piece[start]! >= 0x80) start++;
  while (piece.length - end < 3 && end > start && piece[end - 1]! >= 0x80) end--;
  return isUtf8(piece.subarray(start, end)) ? start : Infinity;
}

const notTheShape = (): KeyfleetError => new KeyfleetError('KF_VALIDATION', 'body: expected a JSON object {"items": [...]} with an array of items');

/** The key a member's raw bytes (up to and with its closing quote) spell; undefined if they are not JSON. */
function keyOf(raw: number[]): string | undefined {
  try {
    return JSON.parse(`"${Buffer.from(raw).toString('utf8')}`) as string;
  } catch {
    return undefined;
  }
}
