import { Readable } from 'node:stream';
import type { FastifyInstance, FastifyRequest } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { publicStatus, type BatchRecord, type BatchStore } from '../../shared/batch-store.js';
import { itemLimit } from '../../shared/crypto/items.js';
import { KeyfleetError } from '../../shared/errors.js';
import { batchAccepted, batchParams, batchStatus, createBatchQuery, errorResponse, resultsQuery } from '../../shared/schemas.js';
import { submitBatch } from '../batch-submit.js';
import { readJsonItems } from '../json-items.js';
import { readNdjsonItems } from '../ndjson-items.js';
import { principalOf, requireScope } from '../plugins/auth.js';
import { streamBatchEvents } from '../sse.js';

const NDJSON = 'application/x-ndjson';

/** The async path: bulk uploads become batches; status, progress, results and cancellation. */
export async function batchRoutes(app: FastifyInstance): Promise<void> {
  const r = app.withTypeProvider<ZodTypeProvider>();
  const { batches } = app.services;
  const tags = ['batches'];

  // Uploads are streamed into chunks by the route itself: hand it the raw body, unread.
  app.removeContentTypeParser(['application/json']);
  for (const type of ['application/json', NDJSON]) {
    app.addContentTypeParser(type, (_request, payload, done) => done(null, payload));
  }

  r.post('/v1/batches', { config: { scope: 'batches' }, schema: { tags, summary: 'Upload items as NDJSON (one JSON string per line) or {"items": [...]}; streamed into a batch', querystring: createBatchQuery, response: { 202: batchAccepted, '4xx': errorResponse } } }, async (request, reply) => {
    const { op, key, encoding } = request.query;
    const { tenant } = requireScope(request, op);
    const body = request.body as AsyncIterable<Buffer> | undefined;
    if (!body) throw new KeyfleetError('KF_UNSUPPORTED_MEDIA_TYPE');
    const ndjson = (request.headers['content-type'] ?? '').startsWith(NDJSON);
    const maxLine = itemLimit(op, encoding, app.keyfleet.maxItemBytes) * 6 + 2; // a JSON string may escape every byte as \u00XX
    const { batchId, total } = await submitBatch(app, { tenant, op, key, encoding, requestId: request.id }, (intake) =>
      ndjson ? readNdjsonItems(body, intake, maxLine) : readJsonItems(body, intake),
    );
    request.log.info({ tenant, batchId, op, total }, 'batch accepted');
    return reply.status(202).send({ batchId, status: 'queued', total });
  });

  r.get('/v1/batches/:id', { schema: { tags, summary: 'Status and counts', params: batchParams, response: { 200: batchStatus, '4xx': errorResponse } } }, async (request) => {
    return publicStatus(await readableBatch(request, batches, request.params.id));
  });

  r.get('/v1/batches/:id/results', { schema: { tags, summary: 'Results as NDJSON in input order: {"i","ciphertext"|"plaintext"|"error"} per line (409 until completed); `from` resumes at an item', params: batchParams, querystring: resultsQuery } }, async (request, reply) => {
    const batch = await readableBatch(request, batches, request.params.id);
    if (batch.deleted) throw new KeyfleetError('KF_BATCH_DELETED');
    if (batch.status !== 'completed') {
      throw new KeyfleetError('KF_BATCH_NOT_READY', `the batch is ${batch.status}; results are ready once it is completed`);
    }
    reply.header('content-type', NDJSON);
    return reply.send(Readable.from(resultChunks(batches, batch, request.query.from), { objectMode: false }));
  });

  r.get('/v1/batches/:id/events', { schema: { tags, summary: 'Server-Sent Events: `progress` with the status, then `done` with the final one', params: batchParams } }, async (request, reply) => {
    const batch = await readableBatch(request, batches, request.params.id);
    await streamBatchEvents(app, request, reply, batch.id);
  });

  r.delete('/v1/batches/:id', { schema: { tags, summary: 'Cancel what has not run and delete the results', params: batchParams, response: { 200: batchStatus, '4xx': errorResponse } } }, async (request) => {
    const batch = await readableBatch(request, batches, request.params.id);
    await batches.cancel(batch.id);
    app.services.metrics.batches.inc({ event: 'cancelled' });
    request.log.info({ tenant: batch.tenant, batchId: batch.id }, 'batch cancelled and deleted');
    return publicStatus((await batches.get(batch.id)) ?? batch);
  });
}

/**
 * The batch, if the caller may see it: another tenant's batch is 404 exactly like a missing one;
 * the `batches` scope or the scope of the batch's own operation grants access.
 */
async function readableBatch(request: FastifyRequest, batches: BatchStore, id: string): Promise<BatchRecord> {
  const principal = principalOf(request);
  const batch = await batches.get(id);
  if (!batch || batch.tenant !== principal.tenant) throw new KeyfleetError('KF_BATCH_NOT_FOUND');
  requireScope(request, 'batches', batch.op);
  return batch;
}

/**
 * Result lines chunk by chunk in input order from item `from` on, reading the next chunk while
 * the current one is sent. Every chunk but the last holds `chunkItems` lines.
 */
async function* resultChunks(batches: BatchStore, batch: BatchRecord, from: number): AsyncGenerator<Buffer> {
  const { id, chunks, chunkItems } = batch;
  if (from >= batch.total) return;
  const first = chunkItems > 0 ? Math.floor(from / chunkItems) : 0;
  let skip = chunkItems > 0 ? from - first * chunkItems : from;
  let next = first < chunks ? batches.readResults(id, first) : undefined;
  for (let chunk = first; chunk < chunks; chunk++) {
    let current = await next!;
    next = chunk + 1 < chunks ? batches.readResults(id, chunk + 1) : undefined;
    if (!current) throw new Error(`batch ${id}: results of chunk ${chunk} are gone (deleted or expired)`);
    for (; skip > 0; skip--) current = current.subarray(current.indexOf(0x0a) + 1);
    yield current;
  }
}

