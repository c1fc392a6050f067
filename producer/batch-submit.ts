import type { FastifyInstance } from 'fastify';
import type { BatchSpec } from '../shared/batch-store.js';
import { itemLimit } from '../shared/crypto/items.js';
import { KeyfleetError } from '../shared/errors.js';
import { checkCallbackUrl } from '../shared/webhooks.js';
import { BatchIntake } from './batch-intake.js';

/**
 * Creates a batch and feeds it from `fill`, which adds items to the intake as they arrive.
 * A batch is sealed only after its last item is stored; an upload that fails part way ends
 * the batch as failed, so a half upload is never processed as if complete.
 */
export async function submitBatch(
  app: FastifyInstance,
  request: Omit<BatchSpec, 'chunkItems'>,
  fill: (intake: BatchIntake) => Promise<void>,
  keepAlive?: () => void,
): Promise<{ batchId: string; total: number }> {
  const { batches, queue } = app.services;
  const { chunkItems, chunkBytes, maxItemBytes, maxBatchItems, maxActiveBatches, maxBacklogItems, webhookSecret, webhookAllowedHosts } = app.keyfleet;
  const callbackUrl = request.callbackUrl === undefined ? undefined : checkCallbackUrl(request.callbackUrl, { secret: webhookSecret, allowedHosts: webhookAllowedHosts });
  const spec: BatchSpec = { ...request, chunkItems, ...(callbackUrl ? { callbackUrl } : {}) };
  // Refused before any byte of the body is read: unknown key (404), a key that cannot do the
  // operation (400), a full queue or too many batches (429).
  await checkKeys(app, spec);
  const backlog = await batches.backlogItems();
  if (backlog >= maxBacklogItems) {
    throw new KeyfleetError('KF_BACKLOG_FULL', `${backlog} items are queued, at or above MAX_BACKLOG_ITEMS (${maxBacklogItems}); retry later`, { retryAfterSeconds: 30 });
  }
  const batchId = await batches.create(spec, maxActiveBatches);
  app.services.metrics.batches.inc({ event: 'created' });
  const intake = new BatchIntake(batchId, spec, batches, queue, {
    chunkItems,
    chunkBytes,
    maxItemBytes: itemLimit(spec.op, spec.encoding, maxItemBytes),
    maxItems: maxBatchItems,
    ...(keepAlive ? { keepAlive } : {}),
  });
  try {
    await fill(intake);
    if (intake.total === 0) throw new KeyfleetError('KF_VALIDATION', 'the upload holds no items');
    if ((await intake.finish()) === 'completed') {
      // Every chunk ran before the seal: sealing completed the batch, so no worker announces it.
      app.services.metrics.batches.inc({ event: 'completed' });
      app.services.webhooks.deliver(batches, batchId);
    }
  } catch (err) {
    const error = err instanceof KeyfleetError ? err : isAbort(err) ? new KeyfleetError('KF_UPLOAD_ABORTED', undefined, { cause: err }) : undefined;
    if (await batches.failUpload(batchId, error?.code ?? 'KF_UPLOAD_ABORTED').catch(() => false)) {
      app.services.metrics.batches.inc({ event: 'failed' });
      app.services.webhooks.deliver(batches, batchId);
    }
    throw error ?? err;
  }
  return { batchId, total: intake.total };
}

const isAbort = (err: unknown): boolean =>
  err instanceof Error && ((err as NodeJS.ErrnoException).code === 'ECONNRESET' || err.message === 'aborted');

/** A targetKey is for a rewrap, into another key than the source. */
export function checkTargetKey(op: BatchSpec['op'], key: string, targetKey: string | undefined): void {
  if (targetKey !== undefined && (op !== 'rewrap' || targetKey === key)) throw new KeyfleetError('KF_TARGET_KEY_INVALID', op !== 'rewrap' ? 'targetKey is for rewrap only' : undefined);
}

/** The batch's keys exist and can do its operation; keys due for rotation rotate now. */
async function checkKeys(app: FastifyInstance, { tenant, op, key, targetKey, context }: BatchSpec): Promise<void> {
  const { keyCache, keyPolicy } = app.services;
  checkTargetKey(op, key, targetKey);
  const opening = op === 'decrypt' || targetKey ? await keyCache.get(tenant, key) : undefined;
  const sealing = op === 'decrypt' ? undefined : await keyPolicy.forEncryption(tenant, targetKey ?? key);
  // A convergent key sealed everything under a context, so every operation on one needs it.
  if ((opening?.convergent || sealing?.convergent) && context === undefined) throw new KeyfleetError('KF_CONTEXT_REQUIRED', 'a convergent key needs a context: pass context= for the batch');
}
