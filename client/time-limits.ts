import { KeyfleetTimeoutError } from './errors.js';

/** The client's limits on waiting for the API, in ms (ClientOptions). */
export interface Limits {
  readonly timeoutMs: number;
  readonly idleTimeoutMs: number;
}

/** What a timeout of one attempt says of its call. */
export interface AttemptOf {
  /** The call changes something (a rotation, a policy, a batch made): once sent whole, the API may have done it. */
  readonly changes: boolean;
  /** The call's Idempotency-Key, if it has one. */
  readonly idempotencyKey?: string | undefined;
  /** An earlier attempt of the call was made: the API may have done it even if this one is cut short. */
  readonly retry: boolean;
}

/** A limit as its message gives it: 300 ms is `0.3 s`. */
const inSeconds = (ms: number): string => `${ms / 1000} s`;

/**
 * The time limits of one attempt of a call. The request is made with `signal`, which also ends
 * it when the caller's own signal does. Each `await…` arms the limit for what the client waits
 * on at that moment; `pause…` disarms it while the client waits on itself (its upload's source,
 * its reader). A limit that passes ends the request, its answer's body included, with a
 * KeyfleetTimeoutError naming the call and the limit. The request (its upload, and the wait for
 * the answer to begin) and the answer's body have a timer each: the API may answer before an
 * upload ends, and the upload's pauses must not switch the answer's limit off.
 */
export class AttemptLimits {
  readonly signal: AbortSignal;
  readonly #controller = new AbortController();
  readonly #url: string;
  readonly #call: string;
  readonly #limits: Limits;
  readonly #of: AttemptOf;
  readonly #request = new Timer();
  readonly #answer = new Timer();
  #answered = false;

  constructor(url: string, call: string, limits: Limits, of: AttemptOf, callerSignal?: AbortSignal) {
    this.#url = url;
    this.#call = call;
    this.#limits = limits;
    this.#of = of;
    this.signal = callerSignal ? AbortSignal.any([callerSignal, this.#controller.signal]) : this.#controller.signal;
  }

  /** The request is sent (an upload: its last piece is handed over); its answer is awaited. */
  awaitAnswer(): void {
    const ms = this.#limits.timeoutMs;
    if (!this.#answered) this.#request.arm(ms, () => this.#end(ms, `no answer from ${this.#url} within ${inSeconds(ms)}`, this.#of.changes));
  }

  /**
   * A piece of the upload is handed over, and the API has yet to take it. An upload cut short
   * makes no batch (the API fails it), but an earlier attempt's may have.
   */
  awaitTaken(): void {
    const ms = this.#limits.idleTimeoutMs;
    if (!this.#answered) this.#request.arm(ms, () => this.#end(ms, `${this.#url} took no more of the upload for ${inSeconds(ms)}`, this.#of.changes && this.#of.retry));
  }

  /**
   * The client reads the next piece of its upload from its source: its own time, not the API's.
   * Only the request's limit is off meanwhile; an answer that began already stays under its own.
   */
  pauseUpload(): void {
    this.#request.disarm();
  }

  /** The answer has begun (before the upload ended, or after): the limits of the request end. */
  answered(): void {
    this.#answered = true;
    this.#request.disarm();
  }

  /** The reader asks for the answer's next piece. */
  awaitPiece(): void {
    const ms = this.#limits.idleTimeoutMs;
    this.#answer.arm(ms, () => this.#end(ms, `the answer from ${this.#url} stopped for ${inSeconds(ms)}`, this.#of.changes));
  }

  /** The reader has the answer's piece, or stopped reading: its own time, not the API's. */
  pauseAnswer(): void {
    this.#answer.disarm();
  }

  #end(ms: number, waited: string, maybeDone: boolean): void {
    this.#controller.abort(new KeyfleetTimeoutError(this.#url, this.#call, ms, waited, { maybeDone, idempotencyKey: this.#of.idempotencyKey }));
  }
}

/** One limit's timer: armed anew for each wait, never more than one at a time; unref'd, as it keeps nothing alive. */
class Timer {
  #timeout: NodeJS.Timeout | undefined;

  arm(ms: number, passed: () => void): void {
    this.disarm();
    this.#timeout = setTimeout(passed, ms).unref();
  }

  disarm(): void {
    clearTimeout(this.#timeout);
    this.#timeout = undefined;
  }
}

/**
 * `res` with its body under the idle limit: each piece its reader asks for must come within
 * idleTimeoutMs. Only while asked for (highWaterMark 0): a reader that takes its time (a full
 * disk's slow writes) is not the API's silence.
 */
export function limitedBody(res: Response, limits: AttemptLimits): Response {
  if (!res.body) return res;
  const reader = res.body.getReader();
  const body = new ReadableStream<Uint8Array>(
    {
      async pull(controller) {
        limits.awaitPiece();
        try {
          const { value, done } = await reader.read();
          if (done) controller.close();
          else controller.enqueue(value);
        } finally {
          limits.pauseAnswer();
        }
      },
      cancel(reason) {
        limits.pauseAnswer();
        return reader.cancel(reason);
      },
    },
    { highWaterMark: 0 },
  );
  return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
}
