import type { FastifyInstance, FastifyReply } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { z } from 'zod';
import type { KeyRing } from '../../shared/crypto/key-ring.js';
import { KeyfleetError } from '../../shared/errors.js';
import { batchAccepted, context as contextSchema, cryptoBody, cryptoParams, cryptoResponse, errorResponse, type BatchOp, type SyncItem } from '../../shared/schemas.js';
import { checkCallbackUrl } from '../../shared/webhooks.js';
import { checkTargetKey, submitBatch } from '../batch-submit.js';
import { answerOnce, jsonAnswer, JSON_TYPE, sendWhenDone, type Answer, type SchemaRequest } from '../idempotency.js';
import { principalOf, requireRewrapScope } from '../plugins/auth.js';
import { errorAnswers } from '../plugins/docs.js';
import { SYNC_RATE_LIMIT } from '../plugins/rate-limit.js';
import { runSync } from '../sync-crypto.js';

/**
 * POST /v1/{encrypt,decrypt,rewrap}/{key}: up to SYNC_MAX_ITEMS items are answered in the
 * response; more (or `mode: "async"`) become a batch and the answer is 202 with its id.
 */
export async function cryptoRoutes(app: FastifyInstance): Promise<void> {
  const r = app.withTypeProvider<ZodTypeProvider>();
  const { keyCache, keyPolicy, metrics, idempotency } = app.services;
  const { syncMaxItems, maxItemBytes, kernel, webhookSecret, webhookAllowedHosts } = app.keyfleet;

  for (const op of ['encrypt', 'decrypt', 'rewrap'] as const satisfies readonly BatchOp[]) {
    const schema = {
      tags: ['crypto'],
      summary: `${op[0]!.toUpperCase()}${op.slice(1)} items: answered in the response up to SYNC_MAX_ITEMS, else a batch (202)`,
      params: cryptoParams,
      body: cryptoBody,
      response: { 200: cryptoResponse, 202: batchAccepted, '4xx': errorResponse },
      docs: { idempotent: true, body: documentedBody(op), responses: errorAnswers('KF_RATE_LIMITED', 'KF_TOO_MANY_BATCHES', 'KF_BACKLOG_FULL') },
    };
    const answer = async (request: SchemaRequest<typeof schema>, reply: FastifyReply): Promise<string | Buffer> => {
      const { tenant } = principalOf(request);
      const { items, encoding, mode, callbackUrl, context, targetKey, keyVersion } = request.body;
      const key = request.params.key;
      const goAsync = mode === 'async' || (mode === 'auto' && items.length > syncMaxItems);
      if (mode === 'sync' && items.length > syncMaxItems) {
        throw new KeyfleetError('KF_SYNC_LIMIT', `at most ${syncMaxItems} items in a synchronous request, got ${items.length}; use mode "auto" or "async"`);
      }
      checkTargetKey(op, key, targetKey);
      // Checked whether or not the request becomes a batch: the same body gets the same verdict
      // at any size, and a bad callbackUrl is found before the day a request first goes async.
      if (callbackUrl !== undefined) checkCallbackUrl(callbackUrl, { secret: webhookSecret, allowedHosts: webhookAllowedHosts });
      if (op === 'rewrap') await requireRewrapScope(request, keyCache, key, targetKey);
      if (keyVersion !== undefined && (op !== 'encrypt' || goAsync)) throw new KeyfleetError('KF_VALIDATION', 'keyVersion is for synchronous encrypt requests only');
      const { texts, contexts, perItemContext } = normalise(op, items, context);
      if (goAsync && perItemContext) {
        throw new KeyfleetError('KF_VALIDATION', 'a context per item is for synchronous requests; a batch takes one context for all its items');
      }

      const work = async (): Promise<Answer> => {
        metrics.countRouting(goAsync ? 'async' : 'sync');
        if (goAsync) {
          const extra = { ...(callbackUrl ? { callbackUrl } : {}), ...(context !== undefined ? { context } : {}), ...(targetKey ? { targetKey } : {}) };
          const { batchId, total } = await submitBatch(app, { tenant, op, key, encoding, requestId: request.id, ...extra }, async (intake) => {
            for (const item of texts) {
              if (item === null) intake.rejectNotString();
              else intake.add(Buffer.from(item, 'utf8'));
              await intake.drain();
            }
          });
          request.log.info({ tenant, batchId, op, total, route: 'async' }, 'request became a batch');
          return jsonAnswer(202, { batchId, status: 'queued', total });
        }
        // Encrypt and same-key rewrap seal under the key's latest version (rotated first when
        // due) or the pinned keyVersion; a rewrap with targetKey opens with this key and seals
        // under the target.
        const ringOf = (fresh: boolean): Promise<KeyRing> =>
          op === 'decrypt' || targetKey ? keyCache.get(tenant, key, { fresh }) : keyPolicy.forEncryption(tenant, key, { version: keyVersion, fresh, count: texts.length });
        let ring = await ringOf(false);
        const target = targetKey ? await keyPolicy.forEncryption(tenant, targetKey, { count: texts.length }) : undefined;
        // A convergent key sealed everything under a context, so every operation on one needs it
        // (an unreadable item fails alone whatever its context).
        if ((ring.convergent || target?.convergent) && contexts?.every((c, i) => c !== undefined || texts[i] === null) !== true) throw new KeyfleetError('KF_CONTEXT_REQUIRED');
        const syncRequest = { op, items: texts, encoding, maxItemBytes, ...(contexts ? { contexts } : {}), ...(target ? { target } : {}) };
        let outcome = runSync(syncRequest, ring, kernel);
        if (outcome.newerVersionSeen) {
          // Some ciphertexts name a version this process has not seen: a rotation elsewhere. A
          // same-key rewrap then seals under that newer version, and counts against it.
          ring = await ringOf(true);
          outcome = runSync(syncRequest, ring, kernel);
        }
        const sealing = op === 'decrypt' ? undefined : (target ?? ring);
        if (sealing) keyPolicy.counted(tenant, sealing, outcome.succeeded);
        metrics.countItems(op, ring.type, outcome.succeeded, outcome.failed);
        // The body is already JSON, written by the kernel; fastify sends a string as it is,
        // without the response schema's serializer (the schema documents the shape).
        return { status: 200, contentType: JSON_TYPE, body: outcome.body };
      };
      // The parsed body stands for the request: the same items, encoding and mode give the same JSON.
      const fingerprintBody = request.headers['idempotency-key'] === undefined ? '' : JSON.stringify(request.body);
      return answerOnce(idempotency, request, reply, tenant, fingerprintBody, work);
    };

    // fastify's callback style (the handler returns nothing): see sendWhenDone.
    r.post(`/v1/${op}/:key`, { config: { scope: op, rateLimit: SYNC_RATE_LIMIT }, schema }, (request, reply) => sendWhenDone(reply, answer(request, reply)));
  }
}

/**
 * The body as each operation reads it, for the document only: the validating schema takes any
 * element of `items`, so that one the operation cannot read fails alone (KF_INVALID_ITEM), not
 * the request, and takes keyVersion and targetKey on every route, to refuse them with a reason.
 */
function documentedBody(op: BatchOp): z.ZodType {
  const field = op === 'encrypt' ? 'plaintext' : 'ciphertext';
  const item = z.object({ [field]: z.string(), context: contextSchema.optional() }).strict();
  const description =
    `A ${field} as a string, or an item object {"${field}", "context"} with a context of its own. Anything else (null, a number, ` +
    `{"${op === 'encrypt' ? 'ciphertext' : 'plaintext'}"}, an object with another field, text with a lone surrogate) fails alone, in its place, as KF_INVALID_ITEM.`;
  const body = cryptoBody.extend({ items: z.array(z.union([z.string(), item]).meta({ description })) });
  return op === 'encrypt' ? body.omit({ targetKey: true }) : op === 'rewrap' ? body.omit({ keyVersion: true }) : body.omit({ targetKey: true, keyVersion: true });
}

/**
 * Items as texts (null where an item could not be read), and their contexts where any was given
 * (an item's own, else the request's). The common request — strings, no context — passes
 * through untouched.
 */
function normalise(op: BatchOp, items: readonly SyncItem[], context: string | undefined): { texts: ReadonlyArray<string | null>; contexts?: ReadonlyArray<string | undefined>; perItemContext: boolean } {
  const isText = (i: SyncItem): i is string | null => i === null || typeof i === 'string';
  if (context === undefined && items.every(isText)) return { texts: items, perItemContext: false };
  // An item object names what it holds: a ciphertext sent to encrypt (or a plaintext to decrypt)
  // is the wrong item, and fails alone, not taken for the other.
  const field = op === 'encrypt' ? 'plaintext' : 'ciphertext';
  const texts = items.map((i) => (isText(i) ? i : ((i as Partial<Record<typeof field, string>>)[field] ?? null)));
  const perItemContext = items.some((i) => !isText(i) && i.context !== undefined);
  if (context === undefined && !perItemContext) return { texts, perItemContext };
  const contexts = items.map((i) => (isText(i) ? context : (i.context ?? context)));
  return { texts, contexts, perItemContext };
}
