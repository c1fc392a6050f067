import type { ServerResponse } from 'node:http';
import type { FastifyReply, onRequestHookHandler } from 'fastify';
import { KeyfleetError } from '../shared/errors.js';

type Tracked = ServerResponse & { [HELD]?: number; [CHUNKED]?: boolean };
const HELD = Symbol('keyfleet.bodyBytesHeld');
const CHUNKED = Symbol('keyfleet.bodyChunked');

const busy = (): KeyfleetError => new KeyfleetError('KF_BUSY', undefined, { retryAfterSeconds: 1 });

/**
 * A bound on the request bodies the API holds at once. fastify reads a JSON body whole (up to
 * MAX_BODY_BYTES) before the handler runs, and by its answer a request has taken several times
 * its body (the bytes, the text, the parsed items, the results): sixteen 16 MB encrypt requests
 * at once took an API to 903–977 MB (ad hoc, sync and batch-making bodies alike), past the 512
 * MiB its Kubernetes limit allows, and an API killed for memory takes every upload and download
 * in flight with it. With the default 48 MiB in flight: 327–374 MB, three taken and thirteen
 * answered 503.
 *
 * `onRequest`, a hook after authentication: a request with a Content-Length reserves it until its
 * response is closed; one that would take the bodies held past `limit` (MAX_BODY_BYTES_IN_FLIGHT)
 * is answered 503 KF_BUSY with Retry-After before its body is read. A chunked body's length is
 * known only as it arrives: it is counted piece by piece (`chunkCounter`, from the body's pause
 * watch), and fails KF_BUSY at the piece that passes the limit. A request is let through whatever
 * its size when nothing else is held, so a limit below MAX_BODY_BYTES slows the API down rather
 * than shutting large bodies out. Routes that read their own bodies (uploads, streamed into
 * chunks) do not count.
 */
export class BodyBudget {
  #held = 0;
  readonly #limit: number;
  readonly #maxBodyBytes: number;

  /** The 'close' listener of every tracked response (`this`): one function, no closure per request. */
  readonly #release: (this: Tracked) => void;

  constructor(limit: number, maxBodyBytes: number) {
    this.#limit = limit;
    this.#maxBodyBytes = maxBodyBytes;
    const budget = this;
    this.#release = function (this: Tracked): void {
      budget.#held -= this[HELD] ?? 0;
    };
  }

  /** Bytes of bodies held now (for tests and metrics). */
  get held(): number {
    return this.#held;
  }

  readonly onRequest: onRequestHookHandler = (request, reply, done) => {
    const { headers } = request;
    const chunked = headers['transfer-encoding'] !== undefined;
    const declared = headers['content-length'];
    if ((!chunked && (declared === undefined || declared === '0')) || request.routeOptions.config?.readsOwnBody) return done();
    // A length past the body limit is refused by fastify's 413 before any of it is held.
    const bytes = chunked ? 0 : Math.min(Number(declared) || 0, this.#maxBodyBytes);
    if (this.#held > 0 && this.#held + bytes > this.#limit) return done(busy());
    this.#held += bytes;
    const res = reply.raw as Tracked;
    res[HELD] = bytes;
    if (chunked) res[CHUNKED] = true;
    // 'close' comes once, when the answer is sent or the connection is gone before it.
    res.on('close', this.#release);
    done();
  };

  /**
   * For a chunked body this budget tracks: counts each piece as it arrives, and gives the error
   * to fail the body with once the bodies held pass the limit (undefined while within it).
   */
  chunkCounter(reply: FastifyReply): ((bytes: number) => KeyfleetError | undefined) | undefined {
    const res = reply.raw as Tracked;
    if (!res[CHUNKED]) return undefined;
    return (bytes) => {
      this.#held += bytes;
      res[HELD]! += bytes;
      return this.#held > this.#limit && res[HELD] !== this.#held ? busy() : undefined;
    };
  }
}
