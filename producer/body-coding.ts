import type { preParsingHookHandler } from 'fastify';
import { KeyfleetError } from '../shared/errors.js';

/**
 * Refuses, before a byte of it is read, a body sent compressed: the API decompresses nothing,
 * and `content-encoding: gzip` was read as the compressed bytes and answered "not valid JSON".
 * 415, saying what to send instead. Only a request that has a body is looked at, after auth.
 * (A charset other than UTF-8 is not refused here: the bytes are what count, and a body that
 * is not UTF-8 is refused as such when it is parsed, KF_INVALID_JSON.)
 */
export const refuseCompressedBodies: preParsingHookHandler = (request, _reply, payload, done) => {
  const coding = request.headers['content-encoding'];
  // Almost every request names none: one header lookup, and on.
  if (coding === undefined) return done(null, payload);
  const hasBody = request.headers['transfer-encoding'] !== undefined || (request.headers['content-length'] ?? '0') !== '0';
  if (hasBody && !coding.split(',').every((c) => /^\s*(identity)?\s*$/i.test(c))) {
    return done(new KeyfleetError('KF_UNSUPPORTED_MEDIA_TYPE', `content-encoding ${coding.slice(0, 32)} is not accepted: send the body uncompressed`));
  }
  done(null, payload);
};
