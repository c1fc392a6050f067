import type { onRequestHookHandler } from 'fastify';
import { KeyfleetError } from '../shared/errors.js';

/**
 * Refuses, before a byte of it is read, a body the API would misread: one sent compressed
 * (`content-encoding: gzip` was read as the compressed bytes and answered "not valid JSON") or
 * declared in another charset than UTF-8 (`charset=utf-16` was parsed as UTF-8 regardless).
 * JSON and NDJSON bodies are UTF-8 text (RFC 8259, 8.1): 415, saying what to send instead.
 */
export const refuseUnreadableBodies: onRequestHookHandler = (request, _reply, done) => {
  const coding = request.headers['content-encoding'];
  if (coding !== undefined && coding.trim().toLowerCase() !== 'identity') {
    return done(new KeyfleetError('KF_UNSUPPORTED_MEDIA_TYPE', `content-encoding ${coding.slice(0, 32)} is not accepted: send the body uncompressed`));
  }
  const type = request.headers['content-type'];
  // Most requests name no charset: one search, and done.
  const charset = type?.includes('charset') ? /;\s*charset\s*=\s*"?([^";\s]*)/i.exec(type)?.[1] : undefined;
  if (charset !== undefined && !/^utf-?8$/i.test(charset)) {
    return done(new KeyfleetError('KF_UNSUPPORTED_MEDIA_TYPE', `charset ${charset.slice(0, 32)} is not accepted: JSON and NDJSON bodies are UTF-8`));
  }
  done();
};
