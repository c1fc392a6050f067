// The client side of keyfleet: a typed client of every route, the CLI's bulk flow, and the
// check a webhook receiver makes.
export { KeyfleetApiError, KeyfleetConnectionError, KeyfleetTimeoutError } from './errors.js';
export { KeyfleetClient, type BatchRequest, type BodySource, type CiphertextItem, type ClientOptions, type CryptoAnswer, type CryptoOptions, type PlaintextItem } from './client.js';
export { runBulk, type BulkOptions, type BulkOutcome } from './bulk.js';
export { RETRYABLE, retryDelayMs, withRetries, type RetryOptions } from './retry.js';
export { readServerEvents, type ServerEvent } from './sse.js';
// The types the client's methods take and answer, as the API's schemas define them.
export type { BatchAccepted, BatchList, BatchOp, BatchStatusBody, CryptoResponse, KeyInfo, KeyList, KeyPolicyPatch, ResultLine } from '../shared/schemas.js';
export type { KeyType } from '../shared/crypto/key-ring.js';
export { SIGNATURE_HEADER, signWebhook, verifyWebhookSignature, type VerifyOptions } from '../shared/webhook-signature.js';
