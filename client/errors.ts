/** An error answer of the API: its HTTP status and its stable `KF_…` code. */
export class KeyfleetApiError extends Error {
  override name = 'KeyfleetApiError';
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
  ) {
    super(`${code} (HTTP ${status}): ${message}`);
  }
}

/**
 * The API could not be reached: nothing listening, a DNS failure, a connection cut before the
 * answer, or (KeyfleetTimeoutError) an API that kept the client waiting past its time limits.
 * The client does not send the request again after one (only after 429 and 503 answers), except
 * a call with an Idempotency-Key that timed out. It has no `status`, unlike KeyfleetApiError: the
 * CLI's download retries exactly the errors without one.
 */
export class KeyfleetConnectionError extends Error {
  override name = 'KeyfleetConnectionError';
  constructor(
    /** The API's base URL: the request's own would show its query, which can carry a context. */
    readonly url: string,
    cause: Error,
    message = `cannot reach ${url} (${failureReason(cause)})`,
  ) {
    super(message, { cause });
  }
}

/**
 * The API kept a call waiting past one of the client's limits (ClientOptions `timeoutMs`,
 * `idleTimeoutMs`): no answer, an answer that stopped, or an upload it stopped taking. The
 * message names the call (method and path, never the query) and the limit, and, when the API
 * may have done the call, says so, with the Idempotency-Key to send it again with if it had one.
 */
export class KeyfleetTimeoutError extends KeyfleetConnectionError {
  override name = 'KeyfleetTimeoutError';
  /** The call changes something, and the API may have done it: it was sent whole or answered, or an earlier attempt was sent. */
  readonly maybeDone: boolean;
  /** The call's Idempotency-Key (the caller's, or the client's own): the same call sent again with it gets the first one's answer, and is not done twice. */
  readonly idempotencyKey: string | undefined;

  constructor(
    url: string,
    /** The call that waited, e.g. `POST /v1/keys/serials/rotate`. */
    readonly call: string,
    /** The limit it waited past, in ms. */
    readonly limitMs: number,
    /** What it waited for, e.g. `no answer from http://127.0.0.1:8080 within 30 s`. */
    readonly waited: string,
    { maybeDone = false, idempotencyKey }: { maybeDone?: boolean; idempotencyKey?: string | undefined } = {},
  ) {
    super(url, new DOMException(`${call}: past ${limitMs} ms`, 'TimeoutError'), `${call}: ${waited}${maybeDone ? `; the API may have done it${idempotencyKey === undefined ? '' : ` (${sendAgainWith(idempotencyKey)})`}` : ''}`);
    this.maybeDone = maybeDone;
    this.idempotencyKey = idempotencyKey;
  }
}

/** How a call the API may have done, or still does, gets its answer. The key may be shown: the client's own is a random id, not a secret. */
export const sendAgainWith = (idempotencyKey: string): string => `send it again with Idempotency-Key ${idempotencyKey} to get its answer without doing it twice`;

/** ECONNREFUSED, ENOTFOUND and the like; undici's own codes say less than its messages ("other side closed"). */
export function failureReason(cause: Error): string {
  const { code } = cause as NodeJS.ErrnoException;
  return code && !code.startsWith('UND_ERR_') ? code : cause.message;
}
