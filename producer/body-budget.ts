import type { ServerResponse } from 'node:http';
import type { onRequestHookHandler } from 'fastify';
import { KeyfleetError } from '../shared/errors.js';

const HELD = Symbol('keyfleet.bodyBytesHeld');

/**
 * A bound on the request bodies the API holds at once. fastify reads a JSON body whole (up to
 * MAX_BODY_BYTES) before the handler runs, and by its answer a request has taken several times
 * its body (the bytes, the text, the parsed items, the results): sixteen 16 MB encrypt requests
 * at once took an API to 903–977 MB (ad hoc, sync and batch-making bodies alike), past the 512
 * MiB its Kubernetes limit allows, and an API killed for memory takes every upload and download
 * in flight with it. With the default 48 MiB in flight: 327–374 MB, three taken and thirteen
 * answered 503.
 *
 * An onRequest hook, after authentication: a request with a body reserves its declared length
 * (MAX_BODY_BYTES when it is chunked) until its response is closed. One that would take the
 * bodies held past `limit` (MAX_BODY_BYTES_IN_FLIGHT) is answered 503 KF_BUSY with Retry-After
 * before its body is read. A request is let through whatever its size when nothing else is held,
 * so a limit below MAX_BODY_BYTES slows the API down rather than shutting large bodies out.
 * Routes that read their own bodies (uploads, streamed into chunks) do not count.
 */
export function bodyBudget(limit: number, maxBodyBytes: number): onRequestHookHandler {
  let held = 0;
  // One listener for every response, the bytes on the response itself: no closure per request
  // on the sync path. 'close' comes once, when the answer is sent or the connection is gone.
  function release(this: ServerResponse & { [HELD]?: number }): void {
    held -= this[HELD] ?? 0;
  }
  return (request, reply, done) => {
    const { headers } = request;
    const chunked = headers['transfer-encoding'] !== undefined;
    const declared = headers['content-length'];
    if ((!chunked && (declared === undefined || declared === '0')) || request.routeOptions.config?.readsOwnBody) return done();
    // A length past the body limit is refused by fastify's 413 before any of it is held.
    const bytes = chunked ? maxBodyBytes : Math.min(Number(declared) || 0, maxBodyBytes);
    if (held > 0 && held + bytes > limit) {
      return done(new KeyfleetError('KF_BUSY', undefined, { retryAfterSeconds: 1 }));
    }
    held += bytes;
    (reply.raw as ServerResponse & { [HELD]?: number })[HELD] = bytes;
    reply.raw.on('close', release);
    done();
  };
}
