/**
 * The error catalogue. Codes are stable API: never reuse or rename one.
 * Messages are fixed text that never carries a plaintext, ciphertext, token or key material.
 */
export const CATALOGUE = {
  KF_UNAUTHORIZED: { status: 401, message: 'a valid bearer token is required' },
  KF_FORBIDDEN: { status: 403, message: 'the token lacks the scope this route needs' },
  KF_NOT_FOUND: { status: 404, message: 'no such route' },
  KF_METHOD_NOT_ALLOWED: { status: 405, message: 'the route does not take this method (Allow lists those it takes)' },
  KF_VALIDATION: { status: 400, message: 'the request does not match the schema' },
  KF_INVALID_JSON: { status: 400, message: 'the body is not valid JSON' },
  KF_BAD_REQUEST: { status: 400, message: 'the request is malformed' },
  KF_PAYLOAD_TOO_LARGE: { status: 413, message: 'the body is larger than the configured limit' },
  KF_UNSUPPORTED_MEDIA_TYPE: { status: 415, message: 'expected application/json' },
  KF_SYNC_LIMIT: { status: 400, message: 'too many items for a synchronous request' },
  KF_KEY_NOT_FOUND: { status: 404, message: 'no such key' },
  KF_KEY_EXISTS: { status: 409, message: 'a key of that name exists with another type' },
  KF_KEY_CONFLICT: { status: 409, message: 'the key changed concurrently; retry' },
  KF_KEY_DELETION_NOT_ALLOWED: { status: 409, message: 'the key is not marked deletionAllowed' },
  KF_KEY_OPERATION_UNSUPPORTED: { status: 400, message: 'the key type does not support this operation' },
  KF_CONTEXT_REQUIRED: { status: 400, message: 'a convergent key needs a context for every item' },
  KF_NONCE_BUDGET_EXHAUSTED: { status: 409, message: 'the key version has made as many encryptions as its nonces allow; rotate the key' },
  KF_TARGET_KEY_INVALID: { status: 400, message: 'targetKey must name another key, of a type that encrypts' },
  KF_KEY_VERSION_INVALID: { status: 400, message: 'the version must be between 1 and the latest version' },
  KF_BATCH_NOT_FOUND: { status: 404, message: 'no such batch' },
  KF_BATCH_NOT_READY: { status: 409, message: 'the batch has not ended' },
  KF_BATCH_DELETED: { status: 410, message: 'the batch results were deleted' },
  KF_BATCH_FAILED: { status: 409, message: 'the batch failed before its upload was complete; it has no results' },
  KF_UPLOAD_ABORTED: { status: 400, message: 'the upload ended before it was complete' },
  KF_CHUNK_FAILED: { status: 500, message: 'a chunk of the batch failed on every attempt' },
  KF_MASTER_KEY_MISMATCH: { status: 500, message: "the key's material is wrapped under another master key; check KEYFLEET_MASTER_KEY" },
  KF_REDIS_UNAVAILABLE: { status: 503, message: 'the backing store is unavailable; retry later', retryAfterSeconds: 5 },
  KF_REDIS_FULL: { status: 503, message: 'the backing store is full; retry later', retryAfterSeconds: 5 },
  KF_BUSY: { status: 503, message: 'the API holds as many request bodies as it may at once; retry shortly' },
  KF_INTERNAL: { status: 500, message: 'internal error' },
  KF_URI_TOO_LONG: { status: 414, message: 'a path segment is longer than any key name or batch id' },
  KF_HEADERS_TOO_LARGE: { status: 431, message: 'the request headers are larger than the server accepts' },
  KF_REQUEST_TIMEOUT: { status: 408, message: 'the request did not arrive in time' },
  KF_CALLBACK_URL_INVALID: { status: 400, message: 'callbackUrl is not an accepted http(s) URL' },
  KF_BATCH_TOO_LARGE: { status: 413, message: 'the batch holds more items than the configured limit' },
  KF_TOO_MANY_BATCHES: { status: 429, message: 'the tenant has too many batches queued or running; retry later' },
  KF_BACKLOG_FULL: { status: 429, message: 'the service has too many items queued; retry later' },
  KF_RATE_LIMITED: { status: 429, message: 'too many requests for this tenant; retry later' },
  KF_IDEMPOTENCY_KEY_INVALID: { status: 400, message: 'Idempotency-Key must be 1-255 printable ASCII characters' },
  KF_IDEMPOTENCY_MISMATCH: { status: 409, message: 'the Idempotency-Key was already used with another request' },
  KF_IDEMPOTENCY_IN_PROGRESS: { status: 409, message: 'a request with this Idempotency-Key is still in progress; retry later' },
  // Item-level codes: they appear inside results, one per failed item.
  KF_DECRYPT_FAILED: { status: 400, message: 'decryption failed' },
  KF_KEY_VERSION_DISABLED: { status: 400, message: 'the ciphertext key version is below minDecryptionVersion' },
  KF_INVALID_ITEM: { status: 400, message: 'the item is not a JSON string of well-formed UTF-8 text (nor, in a synchronous request, a valid item object)' },
  KF_INVALID_ENCODING: { status: 400, message: 'the item is not valid base64' },
  KF_ITEM_TOO_LARGE: { status: 400, message: 'the item is larger than the configured limit' },
  KF_NOT_UTF8: { status: 400, message: 'the plaintext is not valid UTF-8; request encoding "base64"' },
  KF_ITEM_NOT_PROCESSED: { status: 409, message: 'the batch failed before this item was processed (its status says why)' },
} as const satisfies Record<string, { status: number; message: string; retryAfterSeconds?: number }>;

/** KF_UNSUPPORTED_MEDIA_TYPE's message on the upload route, which takes NDJSON besides. */
export const UPLOAD_MEDIA_TYPES = 'expected application/json or application/x-ndjson';

export type ErrorCode = keyof typeof CATALOGUE;

/** The Retry-After the catalogue gives a code (the backing store's 503s), if any. */
export const retryAfterOf = (code: ErrorCode): number | undefined => (CATALOGUE[code] as { retryAfterSeconds?: number }).retryAfterSeconds;

export interface ErrorBody {
  readonly code: ErrorCode;
  readonly message: string;
}

export class KeyfleetError extends Error {
  override name = 'KeyfleetError';
  readonly code: ErrorCode;
  readonly status: number;
  /** Sent as Retry-After: when a 429 or 503 may be retried (the catalogue's, unless given). */
  readonly retryAfterSeconds: number | undefined;

  constructor(code: ErrorCode, message: string = CATALOGUE[code].message, options?: { cause?: unknown; retryAfterSeconds?: number }) {
    super(message, options);
    this.code = code;
    this.status = CATALOGUE[code].status;
    this.retryAfterSeconds = options?.retryAfterSeconds ?? retryAfterOf(code);
  }

  toBody(): ErrorBody {
    return { code: this.code, message: this.message };
  }
}

/** KF_KEY_NOT_FOUND naming the key (a name, never material): with a rewrap's two keys, it says which. */
export const keyNotFound = (name: string): KeyfleetError => new KeyfleetError('KF_KEY_NOT_FOUND', `no key named ${JSON.stringify(name)}`);

/** The JSON of an item-level error, shared by the sync path and the batch kernel. */
export const itemError = (code: ErrorCode): { error: ErrorBody } => ({ error: { code, message: CATALOGUE[code].message } });
