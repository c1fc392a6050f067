import { KeyfleetTimeoutError } from './errors.js';

/** The client's limits on waiting for the API, in ms (ClientOptions). */
export interface Limits {
  readonly timeoutMs: number;
  readonly idleTimeoutMs: number;
}

/** The longest delay Node's timers take (about 24.8 days); a longer one would fire at once. */
export const MAX_LIMIT_MS = 2 ** 31 - 1;

const seconds = (ms: number): string => `${ms / 1000} s`;

/**
 * The time limits of one attempt of a call. The request is made with `signal`, which also ends
 * it when the caller's own signal does. Each `await…` arms the limit for what the client waits
 * on at that moment; `pause` disarms it while the client waits on itself (its upload's source,
 * its reader). A limit that passes ends the request, its answer's body included, with a
 * KeyfleetTimeoutError naming the call and the limit.
 */
export class AttemptLimits {
  readonly signal: AbortSignal;
  readonly #controller = new AbortController();
  readonly #url: string;
  readonly #call: string;
  readonly #limits: Limits;
  readonly #maybeDone: boolean;
  #timer: NodeJS.Timeout | undefined;
  #answered = false;

  /** `maybeDone`: the call is not safe to send twice, and a timeout before its answer says the API may have done it. */
  constructor(url: string, call: string, limits: Limits, maybeDone: boolean, callerSignal?: AbortSignal) {
    this.#url = url;
    this.#call = call;
    this.#limits = limits;
    this.#maybeDone = maybeDone;
    this.signal = callerSignal ? AbortSignal.any([callerSignal, this.#controller.signal]) : this.#controller.signal;
  }

  /** The request is sent (an upload: its last piece is handed over); its answer is awaited. */
  awaitAnswer(): void {
    const ms = this.#limits.timeoutMs;
    if (!this.#answered) this.#arm(ms, `no answer from ${this.#url} within ${seconds(ms)}${this.#maybeDone ? '; the API may have done it' : ''}`);
  }

  /** A piece of the upload is handed over, and the API has yet to take it. */
  awaitTaken(): void {
    const ms = this.#limits.idleTimeoutMs;
    if (!this.#answered) this.#arm(ms, `${this.#url} took no more of the upload for ${seconds(ms)}`);
  }

  /** The answer has begun (before the upload ended, or after): the limits of the request end. */
  answered(): void {
    this.#answered = true;
    this.pause();
  }

  /** The reader asks for the answer's next piece. */
  awaitPiece(): void {
    const ms = this.#limits.idleTimeoutMs;
    this.#arm(ms, `the answer from ${this.#url} stopped for ${seconds(ms)}`);
  }

  pause(): void {
    clearTimeout(this.#timer);
    this.#timer = undefined;
  }

  #arm(ms: number, message: string): void {
    this.pause();
    const error = (): KeyfleetTimeoutError => new KeyfleetTimeoutError(this.#url, this.#call, ms, `${this.#call}: ${message}`);
    this.#timer = setTimeout(() => this.#controller.abort(error()), ms).unref();
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
          limits.pause();
        }
      },
      cancel(reason) {
        limits.pause();
        return reader.cancel(reason);
      },
    },
    { highWaterMark: 0 },
  );
  return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
}
