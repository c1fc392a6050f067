import { JSONParser } from '@streamparser/json';
import { KeyfleetError } from '../shared/errors.js';
import type { BatchIntake } from './batch-intake.js';
import { ItemFramer, type Skipped } from './json-item-framer.js';

/** What the parser is given in place of an element it cannot be given (too large to hold, or not UTF-8): it emits it at once (a number would wait for its end). */
const PLACEHOLDER = Buffer.from('null');

/**
 * Feeds a JSON body `{"items": [...]}` into an intake as it streams in, with a streaming
 * parser that emits one array element at a time. Elements that are not strings, or not
 * well-formed text (a lone surrogate, which would be encoded as U+FFFD), fail alone, in their
 * place. The parser would hold a whole element, or a whole string anywhere, however long:
 * a framer in front of it finds where each element of "items" ends and holds an element back
 * until then, so the parser only ever sees elements of at most `maxElementBytes`. A longer one
 * is skipped to its end and fails alone as KF_ITEM_TOO_LARGE (as an overlong NDJSON line does);
 * one whose bytes are not UTF-8 (on which the parser would fail the whole body) is skipped too,
 * and fails alone as KF_INVALID_ITEM (as such an NDJSON line does). A string or number
 * elsewhere in the body longer than that limit fails the upload (413).
 */
export async function readJsonItems(body: AsyncIterable<Buffer>, intake: BatchIntake, maxElementBytes: number): Promise<void> {
  const parser = new JSONParser({ paths: ['$.items.*'], keepStack: false });
  let failure: Error | undefined;
  let skipped: Skipped | undefined;
  parser.onValue = ({ value }) => {
    const why = skipped;
    skipped = undefined;
    if (why === 'too-large') intake.rejectTooLarge();
    else if (why === undefined && typeof value === 'string' && value.isWellFormed()) intake.add(Buffer.from(value, 'utf8'));
    else intake.rejectNotString();
  };
  // An error thrown by the intake (KF_BATCH_TOO_LARGE) comes back here too: it stays as it is.
  parser.onError = (err) => {
    failure ??= err;
  };
  const failed = (): KeyfleetError | undefined =>
    failure === undefined ? undefined : failure instanceof KeyfleetError ? failure : new KeyfleetError('KF_INVALID_JSON', undefined, { cause: failure });
  const framer = new ItemFramer(maxElementBytes, (bytes) => {
    parser.write(bytes);
    const err = failed();
    if (err) throw err;
  }, (why) => {
    skipped = why;
    parser.write(PLACEHOLDER);
    const err = failed() ?? (skipped ? new KeyfleetError('KF_INVALID_JSON', 'an element of "items" was not where the parser expected it') : undefined);
    if (err) throw err;
  });
  for await (const piece of body) {
    framer.push(piece);
    await intake.drain();
  }
  framer.end();
  if (!parser.isEnded) parser.end();
  const err = failed();
  if (err) throw err;
}
