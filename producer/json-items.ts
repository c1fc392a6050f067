import { JSONParser } from '@streamparser/json';
import { KeyfleetError } from '../shared/errors.js';
import type { BatchIntake } from './batch-intake.js';

/**
 * Feeds a JSON body `{"items": [...]}` into an intake as it streams in, with a streaming
 * parser that emits one array element at a time (memory stays bounded by the chunk, not the
 * body). Elements that are not strings fail alone, in their place.
 */
export async function readJsonItems(body: AsyncIterable<Buffer>, intake: BatchIntake): Promise<void> {
  const parser = new JSONParser({ paths: ['$.items.*'], keepStack: false });
  let failure: Error | undefined;
  parser.onValue = ({ value }) => {
    if (typeof value === 'string') intake.add(Buffer.from(value, 'utf8'));
    else intake.rejectNotString();
  };
  parser.onError = (err) => {
    failure ??= err;
  };
  for await (const piece of body) {
    parser.write(piece);
    if (failure) throw new KeyfleetError('KF_INVALID_JSON', undefined, { cause: failure });
    await intake.drain();
  }
  if (!parser.isEnded) parser.end();
  if (failure) throw new KeyfleetError('KF_INVALID_JSON', undefined, { cause: failure });
}
