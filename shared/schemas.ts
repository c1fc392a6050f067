import { z } from 'zod';
import { KEY_NAME } from './crypto/format.js';
import { CREATABLE_KEY_TYPES, KEY_TYPES } from './crypto/key-ring.js';

export const BATCH_OPS = ['encrypt', 'decrypt', 'rewrap'] as const;
export type BatchOp = (typeof BATCH_OPS)[number];
export const BATCH_STATUSES = ['queued', 'running', 'completed', 'failed', 'cancelled'] as const;
export type BatchStatus = (typeof BATCH_STATUSES)[number];
export const TERMINAL_STATUSES: ReadonlySet<BatchStatus> = new Set(['completed', 'failed', 'cancelled']);

export const keyName = z.string().regex(KEY_NAME, 'expected 1-128 characters of [A-Za-z0-9._-]');
/**
 * The name of a key being made: not `.` or `..`, which in a URL path are dot segments that
 * clients resolve away (made with a raw path, such a key could be reached only through a query
 * or a body). Refused when a key is made only, so one made before stays usable and deletable. A
 * refinement, so that the OpenAPI pattern stays one every code generator reads (no lookahead).
 */
const newKeyName = keyName.refine((name) => name !== '.' && name !== '..', 'expected 1-128 characters of [A-Za-z0-9._-], not . or ..');
export const encoding = z.enum(['utf8', 'base64']);
export const batchOp = z.enum(BATCH_OPS);

// ---- keys --------------------------------------------------------------------------------
export const keyParams = z.object({ name: keyName });
export const newKeyParams = z.object({ name: newKeyName });
export const createKeyBody = z
  .object({
    type: z.enum(CREATABLE_KEY_TYPES).default('aes256-gcm96'),
    /** Same plaintext and context → same ciphertext (lookups by ciphertext); every call then needs a context. */
    convergent: z.boolean().default(false),
  })
  .strict();
export const importKeyBody = z
  .object({
    type: z.literal('legacy-aes256-cbc'),
    /** base64 of the 32-byte AES-256 key of the legacy system. */
    material: z.string().regex(/^[A-Za-z0-9+/]{43}=$/, 'expected base64 of exactly 32 bytes'),
  })
  .strict();
export const patchKeyBody = z
  .object({
    minDecryptionVersion: z.number().int().min(1).optional(),
    /** The lowest version an encrypt call may pin with keyVersion. */
    minEncryptionVersion: z.number().int().min(1).optional(),
    /** Allows DELETE /v1/keys/{name}. */
    deletionAllowed: z.boolean().optional(),
    /** Seconds after which the next encryption rotates the key first; 0 turns it off. */
    autoRotatePeriod: z.number().int().min(0).max(10 * 365 * 86_400).optional(),
  })
  .strict()
  .refine((p) => Object.keys(p).length > 0, 'expected at least one of minDecryptionVersion, minEncryptionVersion, deletionAllowed, autoRotatePeriod');
export type KeyPolicyPatch = z.infer<typeof patchKeyBody>;
export const trimKeyBody = z.object({ minAvailableVersion: z.number().int().min(1) }).strict();
export const keyInfo = z.object({
  name: z.string(),
  type: z.enum(KEY_TYPES),
  convergent: z.boolean(),
  latestVersion: z.number().int(),
  minDecryptionVersion: z.number().int(),
  minEncryptionVersion: z.number().int(),
  deletionAllowed: z.boolean(),
  autoRotatePeriod: z.number().int(),
  createdAt: z.string(),
});
export type KeyInfo = z.infer<typeof keyInfo>;
const PAGE_SIZE = 'expected a whole number from 1 to 1000';
/** Items of a listing's page: 1 to 1,000, 100 by default. Digits only, as `from`. */
const pageSize = z.string().regex(/^\d{1,4}$/, PAGE_SIZE).transform(Number).pipe(z.number().min(1, PAGE_SIZE).max(1000, PAGE_SIZE)).default(100);
/** Keys listed a page at a time, in name order. */
export const listKeysQuery = z.object({
  /** Names after this one: the `next` of the page before. */
  after: keyName.optional(),
  /** Keys in the page, 1 to 1,000. */
  limit: pageSize,
}).strict();
export const keyList = z.object({
  keys: z.array(keyInfo),
  /** Present when more keys follow: pass it as `after` for the next page. */
  next: z.string().optional(),
});
export type KeyList = z.infer<typeof keyList>;
/** The longest context, in characters (code points: zod counts a string's length in them). */
const CONTEXT_MAX = 1024;
/**
 * A context: bound into the associated data; decrypt and rewrap need the same one. Well-formed
 * text: encoded, a lone surrogate would become U+FFFD, binding another context than was sent.
 */
export const context = z.string().min(1).max(CONTEXT_MAX).refine((c) => c.isWellFormed(), 'expected well-formed text (no lone surrogate)');

// ---- sync crypto ---------------------------------------------------------------------------
export const cryptoParams = z.object({ key: keyName });
const plaintextItem = z.object({ plaintext: z.string(), context: context.optional() }).strict();
const ciphertextItem = z.object({ ciphertext: z.string(), context: context.optional() }).strict();
/** An item object: an item with its own context. */
export type ItemObject = z.infer<typeof plaintextItem> | z.infer<typeof ciphertextItem>;
/** An item as the sync routes read it: a string, an item object, or null for anything else. */
export type SyncItem = string | ItemObject | null;

/**
 * A string that is well-formed text. A lone surrogate (a JSON escape such as "\ud800" that
 * makes no character) would be encoded as U+FFFD: the service would encrypt other text than
 * was sent.
 */
const isText = (value: unknown): value is string => typeof value === 'string' && value.isWellFormed();
/** `context`'s check, without the cost of an issue when it fails. A code point is 1-2 UTF-16 units. */
const isContext = (value: unknown): value is string =>
  isText(value) && value.length >= 1 && (value.length <= CONTEXT_MAX || (value.length <= 2 * CONTEXT_MAX && [...value].length <= CONTEXT_MAX));

/**
 * An element of a sync request's items as an item. One that is neither a string nor an item
 * object (strict: no other field; a context of 1-1024 characters), or whose text is not
 * well-formed, is null: it fails alone, in its place, as KF_INVALID_ITEM (as a bad line of an
 * upload does) instead of failing the request.
 *
 * Checked by hand rather than by a zod union that `.catch`es: the union builds its issues for
 * every element that fails it (a million numbers: 2.8 s, against 37 ms for this check), so that
 * a 16 MB body of numbers held the event loop, and every other request, for over 20 s.
 */
export function readSyncItem(element: unknown): SyncItem {
  if (typeof element === 'string') return isText(element) ? element : null;
  if (typeof element !== 'object' || element === null) return null;
  const { plaintext, ciphertext, context: own } = element as Record<string, unknown>;
  if (own !== undefined && !isContext(own)) return null;
  // The text field and the context if given, nothing else (an array has no such fields).
  if (Object.keys(element).length !== (own === undefined ? 1 : 2)) return null;
  const withContext = own === undefined ? {} : { context: own };
  if (isText(plaintext)) return { plaintext, ...withContext };
  if (isText(ciphertext)) return { ciphertext, ...withContext };
  return null;
}

const syncItems = z
  // Any element: one the operation cannot read fails alone. The document shows each route's
  // items as it reads them (documentedBody, producer/routes/crypto.ts).
  .array(z.unknown())
  .transform((elements) => elements.map(readSyncItem));
export const cryptoBody = z
  .object({
    items: syncItems,
    /** The context of every item that does not give its own. */
    context: context.optional(),
    /** Rewrap only: re-encrypt into this key (e.g. from a legacy key into a modern one). */
    targetKey: keyName.optional(),
    /** Encrypt only, sync only: seal under this version (minEncryptionVersion..latest) instead of the latest. */
    keyVersion: z.number().int().min(1).optional(),
    encoding: encoding.default('utf8'),
    mode: z.enum(['auto', 'sync', 'async']).default('auto'),
    /** When the request becomes a batch: where its final status is POSTed, signed (checked either way). */
    callbackUrl: z.string().max(2048).optional(),
  })
  .strict();
export type CryptoBody = z.infer<typeof cryptoBody>;

const errorBody = z.object({ code: z.string(), message: z.string() });
export const errorResponse = z.object({ error: errorBody });
export const itemResult = z.union([
  z.object({ ciphertext: z.string() }),
  z.object({ plaintext: z.string() }),
  z.object({ error: errorBody }),
]);
export const cryptoResponse = z.object({ results: z.array(itemResult) });
export type CryptoResponse = z.infer<typeof cryptoResponse>;

// ---- batches -------------------------------------------------------------------------------
export const createBatchQuery = z.object({
  op: batchOp,
  key: keyName,
  encoding: encoding.default('utf8'),
  /** Where the final status is POSTed, signed with Keyfleet-Signature (WEBHOOK_SECRET). */
  callbackUrl: z.string().max(2048).optional(),
  /** The context of every item of the batch. */
  context: context.optional(),
  /** op=rewrap only: re-encrypt into this key (migration). */
  targetKey: keyName.optional(),
}).strict(); // a mistyped parameter (ctx= for context=) is a 400, not a batch without it
export const resultsQuery = z.object({
  /** The first item to send: a client that lost its download resumes from the lines it kept. */
  // Digits only: a number's other spellings (1e3, 0x10, an empty value read as 0) are refused.
  from: z.string().regex(/^\d{1,15}$/, 'expected a whole number of items').transform(Number).default(0),
}).strict();
const batchId = z.string().regex(/^[A-Za-z0-9_-]{8,64}$/, 'expected a batch id');
export const batchParams = z.object({ id: batchId });
export const batchAccepted = z.object({ batchId: z.string(), status: z.enum(BATCH_STATUSES), total: z.number().int() });
export const batchStatus = z.object({
  id: z.string(),
  op: batchOp,
  key: z.string(),
  status: z.enum(BATCH_STATUSES),
  total: z.number().int(),
  processed: z.number().int(),
  succeeded: z.number().int(),
  failed: z.number().int(),
  createdAt: z.string(),
  finishedAt: z.string().optional(),
  error: errorBody.optional(),
  /** Present once DELETE removed the batch's results; `status` stays what the batch had reached. */
  resultsDeleted: z.literal(true).optional(),
});
export type BatchStatusBody = z.infer<typeof batchStatus>;
/** Batches listed a page at a time, newest first. */
export const listBatchesQuery = z.object({
  /** Batches made before this point: the `next` of the page before. */
  before: z.string().regex(/^\d{1,16}$/, 'expected the `next` a page before this one gave (digits)').transform(Number).optional(),
  /** Batches in the page, 1 to 1,000. */
  limit: pageSize,
}).strict();
export const batchList = z.object({
  batches: z.array(batchStatus),
  /** Present when more batches may follow: pass it as `before` for the next page. */
  next: z.string().optional(),
});
export type BatchList = z.infer<typeof batchList>;
/** One line of a batch's results (NDJSON): the item's index and its result or error. */
export const resultLine = z.object({
  i: z.number().int(),
  ciphertext: z.string().optional(),
  plaintext: z.string().optional(),
  error: errorBody.optional(),
});
export type ResultLine = z.infer<typeof resultLine>;
export type BatchAccepted = z.infer<typeof batchAccepted>;
export type ItemResult = z.infer<typeof itemResult>;

// ---- queue ---------------------------------------------------------------------------------
/** A queued chunk references its input in Redis; it never carries items itself. */
export const chunkJobData = z.object({
  batchId: z.string().min(1),
  tenant: z.string().min(1),
  chunk: z.number().int().min(0),
  firstIndex: z.number().int().min(0),
  count: z.number().int().min(0),
  op: batchOp,
  key: keyName,
  encoding,
  /** The id of the request that created the batch, so worker logs join up with API logs. */
  requestId: z.string().max(64).optional(),
  /** The batch's context, sealed (BatchStore.sealContext): base64 of up to 4 bytes a character and 28 more. */
  sealedContext: z.string().max(8 * CONTEXT_MAX).optional(),
  /**
   * The context in the clear, as an earlier API put it in its jobs; beside `sealedContext`, ''.
   * An earlier worker reads only this field and wants a context of 1 character at least: it
   * refuses such a job (the chunk fails, and its batch) rather than run it without the context.
   */
  context: z.union([context, z.literal('')]).optional(),
  targetKey: keyName.optional(),
  /**
   * `records` from an API that formats results as it streams them (shared/result-codec.ts).
   * A job without it comes from an earlier API, which streams what is stored as it is: the
   * worker stores NDJSON lines for it.
   */
  resultFormat: z.literal('records').optional(),
  /**
   * `tenant` from an API that seals a batch's inputs, results and context for its tenant as well
   * as the batch (BatchStore's `owner`). An earlier worker drops the field and opens nothing: the
   * chunk fails (roll the workers over first).
   */
  sealedFor: z.literal('tenant').optional(),
});
export type ChunkJobData = z.infer<typeof chunkJobData>;
