import type { Hash } from 'node:crypto';
import { Readable } from 'node:stream';
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { batchOwner, publicStatus, type BatchRecord, type BatchStore, type ChunkLayout } from '../../shared/batch-store.js';
import { itemLimit } from '../../shared/crypto/items.js';
import { resolveKernel, resultFormatter } from '../../shared/crypto/kernel.js';
import { KeyfleetError, UPLOAD_MEDIA_TYPES } from '../../shared/errors.js';
import { Handover } from '../../shared/handover.js';
import { notProcessedLines, resultLines, type NativeFormatter } from '../../shared/result-codec.js';
import { batchAccepted, batchList, batchParams, batchStatus, createBatchQuery, errorResponse, listBatchesQuery, resultsQuery } from '../../shared/schemas.js';
import { submitBatch } from '../batch-submit.js';
import { fingerprintHash, idempotencyKeyOf, jsonAnswer, replay, respondCompleted, sendWhenDone, type SchemaRequest } from '../idempotency.js';
import { readJsonItems } from '../json-items.js';
import { readNdjsonItems } from '../ndjson-items.js';
import { hasScope, principalOf, requireRewrapScope, requireScope } from '../plugins/auth.js';
import { errorAnswers } from '../plugins/docs.js';
import { reclaiming } from '../reclaim.js';
import { announceAbandoned } from '../services.js';
import { streamBatchEvents } from '../sse.js';

const NDJSON = 'application/x-ndjson';

// For the document only (RouteDocs): the upload reads its own body, and /results and /events
// stream theirs, so none has a schema fastify would validate or serialize by.
const uploadItem = 'An item: a JSON string (a plaintext for op=encrypt, base64 with encoding=base64; a ciphertext for decrypt and rewrap). Anything else (null, a number, an object, text with a lone surrogate, bytes that are not UTF-8) fails alone, in its place, as KF_INVALID_ITEM; one longer than MAX_ITEM_BYTES as KF_ITEM_TOO_LARGE.';
const uploadBody = {
  [NDJSON]: z.string().meta({ format: 'binary', description: `One item per line (blank lines are none). ${uploadItem}`, example: '"LIC-0000001"\n"LIC-0000002"\n' }),
  'application/json': z.object({ items: z.array(z.string().meta({ description: uploadItem })).min(1) }),
};
const resultsAnswer = {
  description: 'The results, one line per item in input order from `from`',
  content: {
    [NDJSON]: {
      schema: z.string().meta({
        format: 'binary',
        description: 'NDJSON: {"i": <index>, "ciphertext": "…"} (or "plaintext") per item, or {"i", "error": {"code", "message"}} for one that failed; of a batch that failed after its upload, KF_ITEM_NOT_PROCESSED for each item of the chunks that never ran',
        example: '{"i":0,"ciphertext":"kf:v2:…"}\n{"i":1,"error":{"code":"KF_INVALID_ITEM","message":"…"}}\n',
      }),
    },
  },
};
const batchEvents = {
  description: 'The batch’s progress as Server-Sent Events',
  content: {
    'text/event-stream': {
      schema: z.string().meta({
        description: '`progress` events whose data is the status (as GET /v1/batches/{id}), now and after every change, then one `done` event with the final status (`{"id", "status": "deleted"}` for a batch gone meanwhile), and the stream ends. Comment lines keep it alive.',
        example: 'event: progress\ndata: {"id":"…","status":"running",…}\n\nevent: done\ndata: {"id":"…","status":"completed",…}\n\n',
      }),
    },
  },
};

/** The async path: bulk uploads become batches; status, progress, results and cancellation. */
export async function batchRoutes(app: FastifyInstance): Promise<void> {
  const r = app.withTypeProvider<ZodTypeProvider>();
  const { batches } = app.services;
  const tags = ['batches'];
  // KEYFLEET_KERNEL=js keeps the addon out of uploads too.
  const packNatively = resolveKernel(app.keyfleet.kernel) === 'native';
  const formatter = resultFormatter(app.keyfleet.kernel);

  // Uploads are streamed into chunks by the route itself: hand it the raw body, unread. Only
  // JSON and NDJSON are uploads; any other type (text/plain included) is a 415.
  app.removeAllContentTypeParsers();
  for (const type of ['application/json', NDJSON]) {
    app.addContentTypeParser(type, (_request, payload, done) => done(null, payload));
  }

  const uploadSchema = { tags, summary: 'Upload items as NDJSON (one JSON string per line) or {"items": [...]}; streamed into a batch', querystring: createBatchQuery, response: { 202: batchAccepted, '4xx': errorResponse }, docs: { idempotent: true, body: uploadBody, responses: errorAnswers('KF_TOO_MANY_BATCHES', 'KF_BACKLOG_FULL') } };
  const upload = async (request: SchemaRequest<typeof uploadSchema>, reply: FastifyReply): Promise<unknown> => {
    const { op, key, encoding, callbackUrl, context, targetKey } = request.query;
    const { tenant } = requireScope(request, op);
    if (op === 'rewrap') await requireRewrapScope(request, app.services.keyCache, key, targetKey);
    if (!request.body) throw new KeyfleetError('KF_UNSUPPORTED_MEDIA_TYPE', UPLOAD_MEDIA_TYPES);
    const body = reclaiming(idleBounded(request.body as AsyncIterable<Buffer>, app.keyfleet.uploadIdleSeconds));
    // Media types are case-insensitive (RFC 9110), as fastify matches the parsers above.
    const ndjson = (request.headers['content-type'] ?? '').toLowerCase().startsWith(NDJSON);
    const maxLine = itemLimit(op, encoding, app.keyfleet.maxItemBytes) * 6 + 2; // a JSON string may escape every byte as \u00XX (NDJSON lines, JSON elements)
    const submit = async (items: AsyncIterable<Buffer>, keepAlive?: () => void) => {
      const { batchId, total } = await submitBatch(app, { tenant, op, key, encoding, requestId: request.id, ...(callbackUrl ? { callbackUrl } : {}), ...(context !== undefined ? { context } : {}), ...(targetKey ? { targetKey } : {}) }, (intake) =>
        ndjson ? readNdjsonItems(items, intake, maxLine, { native: packNatively }) : readJsonItems(items, intake, maxLine), keepAlive,
      );
      request.log.info({ tenant, batchId, op, total }, 'batch accepted');
      return { batchId, status: 'queued' as const, total };
    };

    const idempotencyKey = idempotencyKeyOf(request);
    if (idempotencyKey === undefined) {
      const accepted = await submit(body);
      reply.status(202);
      return accepted;
    }
    // The body's fingerprint is known only once it has been read: a repeat is read (and hashed)
    // to tell "the same upload again" from "another upload with the same key".
    const { idempotency } = app.services;
    const fingerprint = fingerprintHash(request);
    const stored = await idempotency.find(tenant, idempotencyKey, async () => {
      for await (const piece of body) fingerprint.update(piece);
      return fingerprint.digest('hex');
    });
    if (stored) return replay(reply, stored);
    await idempotency.claim(tenant, idempotencyKey, 'upload in progress');
    let accepted: Awaited<ReturnType<typeof submit>>;
    try {
      accepted = await submit(hashing(body, fingerprint), () => void idempotency.renew(tenant, idempotencyKey).catch(() => {}));
    } catch (err) {
      await idempotency.release(tenant, idempotencyKey).catch(() => {});
      throw err;
    }
    return respondCompleted(idempotency, request, reply, tenant, idempotencyKey, fingerprint.digest('hex'), jsonAnswer(202, accepted));
  };

  // fastify's callback style (the handler returns nothing): see sendWhenDone.
  r.post('/v1/batches', { config: { scope: 'batches', readsOwnBody: true }, schema: uploadSchema }, (request, reply) => sendWhenDone(reply, upload(request, reply)));

  r.get('/v1/batches', { schema: { tags, summary: 'The tenant’s batches, newest first, `limit` (100; at most 1,000) a page; `next` is the `before` of the page that follows. A token without the batches scope sees the batches of its operations', querystring: listBatchesQuery, response: { 200: batchList, '4xx': errorResponse } } }, async (request) => {
    const principal = requireScope(request, 'batches', 'encrypt', 'decrypt', 'rewrap');
    const { batches: listed, next } = await batches.list(principal.tenant, request.query);
    const visible = listed.filter((batch) => hasScope(principal, 'batches', batch.op));
    return { batches: await Promise.all(visible.map(async (batch) => publicStatus(await settled(app, batch)))), ...(next !== undefined ? { next } : {}) };
  });

  r.get('/v1/batches/:id', { schema: { tags, summary: 'Status and counts', params: batchParams, response: { 200: batchStatus, '4xx': errorResponse } } }, async (request) => {
    return publicStatus(await readableBatch(app, request, request.params.id));
  });

  r.get('/v1/batches/:id/results', { schema: { tags, summary: 'Results as NDJSON in input order: {"i","ciphertext"|"plaintext"|"error"} per line (409 until the batch has ended, and for one that failed during its upload; of one that failed later, KF_ITEM_NOT_PROCESSED for the items that never ran); `from` resumes at an item', params: batchParams, querystring: resultsQuery, docs: { responses: { 200: resultsAnswer, '4xx': errorResponse, ...errorAnswers('KF_BATCH_NOT_FOUND', 'KF_BATCH_NOT_READY', 'KF_BATCH_FAILED', 'KF_BATCH_DELETED') } } } }, async (request, reply) => {
    const batch = await readableBatch(app, request, request.params.id);
    if (batch.deleted) throw new KeyfleetError('KF_BATCH_DELETED');
    // A failed batch never completes: a caller waiting on KF_BATCH_NOT_READY would wait for ever.
    // One that failed once its upload was whole gives what its chunks that ran made, and a
    // KF_ITEM_NOT_PROCESSED line for each item of the others: the work done is not lost. One
    // that failed during its upload never had all its items: it has no results.
    if (batch.status === 'failed' && !batch.sealed) {
      throw new KeyfleetError('KF_BATCH_FAILED', `the batch failed during its upload${batch.error ? ` (${batch.error.code})` : ''}; it has no results (GET /v1/batches/${batch.id} says why)`);
    }
    if (batch.status !== 'completed' && batch.status !== 'failed') {
      throw new KeyfleetError('KF_BATCH_NOT_READY', `the batch is ${batch.status}; results are ready once it has ended`);
    }
    // `from` equal to the total reads nothing (a download that had every line); past it, the
    // caller has lines this batch never had (another batch's file, say): an empty 200 would hide that.
    if (request.query.from > batch.total) {
      throw new KeyfleetError('KF_VALIDATION', `querystring.from: ${request.query.from} is past the batch's end (it holds ${batch.total} items; from=${batch.total} reads none)`);
    }
    // The first chunk is read before the answer starts, so that a batch deleted since the check
    // above is still a 410; one deleted later cuts the download short.
    const layout = await batches.chunkLayout(batch);
    const ran = batch.status === 'failed' ? await chunksThatRan(batches, batch, layout) : () => true;
    const start = startOf(batch, layout, request.query.from);
    const first = start && ran(start.chunk) ? (await batches.readResults(batch.id, batchOwner(batch), start.chunk)).take() : null;
    if (start && ran(start.chunk) && !first) throw new KeyfleetError('KF_BATCH_DELETED');
    reply.header('content-type', NDJSON);
    return reply.send(Readable.from(start ? reclaiming(resultChunks(batches, batch, layout, ran, start, new Handover(first), formatter)) : [], { objectMode: false }));
  });

  r.get('/v1/batches/:id/events', { schema: { tags, summary: 'Server-Sent Events: `progress` with the status, then `done` with the final one', params: batchParams, docs: { responses: { 200: batchEvents, '4xx': errorResponse, ...errorAnswers('KF_BATCH_NOT_FOUND') } } } }, async (request, reply) => {
    const batch = await readableBatch(app, request, request.params.id);
    await streamBatchEvents(app, request, reply, batch.id);
  });

  r.delete('/v1/batches/:id', { schema: { tags, summary: 'Cancel what has not run and delete the results', params: batchParams, response: { 200: batchStatus, '4xx': errorResponse } } }, async (request) => {
    const batch = await readableBatch(app, request, request.params.id);
    if (await batches.cancel(batch.id)) {
      app.services.webhooks.deliver(batches, batch.id);
      app.services.metrics.batches.inc({ event: 'cancelled' });
      request.log.info({ tenant: batch.tenant, batchId: batch.id }, 'batch cancelled and deleted');
    } else {
      request.log.info({ tenant: batch.tenant, batchId: batch.id, status: batch.status }, 'batch deleted');
    }
    return publicStatus((await batches.get(batch.id)) ?? batch);
  });
}

/**
 * The batch, if the caller may see it: another tenant's batch is 404 exactly like a missing one;
 * the `batches` scope or the scope of the batch's own operation grants access.
 */
async function readableBatch(app: FastifyInstance, request: FastifyRequest, id: string): Promise<BatchRecord> {
  const { batches } = app.services;
  const principal = principalOf(request);
  const batch = await batches.get(id);
  if (!batch || batch.tenant !== principal.tenant) throw new KeyfleetError('KF_BATCH_NOT_FOUND');
  requireScope(request, 'batches', batch.op);
  return settled(app, batch);
}

/** The batch as it stands: an upload whose API died shows as failed, not as queued for ever. */
async function settled(app: FastifyInstance, batch: BatchRecord): Promise<BatchRecord> {
  const { batches } = app.services;
  if (batch.sealed || (batch.status !== 'queued' && batch.status !== 'running') || !(await batches.failIfAbandoned(batch.id))) return batch;
  announceAbandoned(app.services, batch.id);
  return (await batches.get(batch.id)) ?? batch;
}

/**
 * The body, failing with 408 KF_REQUEST_TIMEOUT when nothing arrives for `seconds`
 * (UPLOAD_IDLE_SECONDS), so that a client stalled mid-upload does not hold its batch open.
 * The read left waiting is abandoned (the error handler closes the connection of a request
 * answered before its body ended).
 */
async function* idleBounded(body: AsyncIterable<Buffer>, seconds: number): AsyncGenerator<Buffer> {
  const pieces = body[Symbol.asyncIterator]();
  for (;;) {
    let timer: NodeJS.Timeout | undefined;
    const idle = new Promise<never>((_resolve, fail) => {
      timer = setTimeout(() => fail(new KeyfleetError('KF_REQUEST_TIMEOUT', `the upload sent nothing for ${seconds} s (UPLOAD_IDLE_SECONDS)`)), seconds * 1000);
    });
    const next = pieces.next();
    next.catch(() => {}); // settles after the timeout, if ever: nobody waits for it then
    let piece: IteratorResult<Buffer>;
    try {
      piece = await Promise.race([next, idle]);
    } finally {
      clearTimeout(timer); // only waiting on the client counts, not the time the piece takes to store
    }
    if (piece.done) return;
    yield piece.value;
  }
}

/** Passes the body through while hashing it. */
async function* hashing(body: AsyncIterable<Buffer>, hash: Hash): AsyncGenerator<Buffer> {
  for await (const piece of body) {
    hash.update(piece);
    yield piece;
  }
}

/** Where a download from item `from` starts: the chunk, and the lines of it to skip; none past the end. */
function startOf(batch: BatchRecord, layout: ChunkLayout, from: number): { chunk: number; skip: number } | undefined {
  if (from >= batch.total) return undefined;
  const chunk = layout.chunkOf(from);
  return { chunk, skip: from - layout.firstIndex(chunk) };
}

/** The index after the chunk's last item. */
const chunkEnd = (batch: BatchRecord, layout: ChunkLayout, chunk: number): number => (chunk + 1 < batch.chunks ? layout.firstIndex(chunk + 1) : batch.total);

/**
 * Which chunks of a failed batch ran. Their items must add up to what the batch processed: a
 * bitmap gone since the record was read (deleted, or evicted) would otherwise mark every item
 * as never processed, where the truth is that the results are gone.
 */
async function chunksThatRan(batches: BatchStore, batch: BatchRecord, layout: ChunkLayout): Promise<(chunk: number) => boolean> {
  const ran = await batches.chunksRan(batch.id);
  let items = 0;
  for (let chunk = 0; chunk < batch.chunks; chunk++) if (ran(chunk)) items += chunkEnd(batch, layout, chunk) - layout.firstIndex(chunk);
  if (items !== batch.processed) throw new KeyfleetError('KF_BATCH_DELETED');
  return ran;
}

/**
 * Result lines chunk by chunk in input order from `start` on (its chunk's results already read,
 * if it ran), reading the next chunk while the current one is formatted and sent. A chunk that
 * never ran (`ran`: its batch failed first) gives a KF_ITEM_NOT_PROCESSED line per item.
 */
async function* resultChunks(batches: BatchStore, batch: BatchRecord, layout: ChunkLayout, ran: (chunk: number) => boolean, start: { chunk: number; skip: number }, first: Handover<Buffer | null>, formatter: NativeFormatter | undefined): AsyncGenerator<Buffer> {
  const { id, chunks } = batch;
  const owner = batchOwner(batch);
  // A read ahead is awaited only once the chunk before it is sent: its failure (Redis gone, a
  // timeout) or the client leaving first must not go unhandled meanwhile, or the process ends.
  // Its results come in a handover, so that the promises around it do not keep them (shared/handover.ts).
  const readAhead = (chunk: number): Promise<Handover<Buffer | null>> | undefined => {
    if (chunk >= chunks) return undefined;
    if (!ran(chunk)) return Promise.resolve(new Handover<Buffer | null>(null));
    const read = batches.readResults(id, owner, chunk);
    read.catch(() => {});
    return read;
  };
  let next: Promise<Handover<Buffer | null>> | undefined = Promise.resolve(first);
  let skip = start.skip;
  for (let chunk = start.chunk; chunk < chunks; chunk++) {
    const current = (await next!).take();
    next = readAhead(chunk + 1);
    const firstIndex = layout.firstIndex(chunk);
    if (!ran(chunk)) yield* notProcessedLines(firstIndex + skip, chunkEnd(batch, layout, chunk));
    else if (!current) throw new Error(`batch ${id}: results of chunk ${chunk} are gone (deleted or expired)`);
    else yield* resultLines(current, firstIndex, skip, formatter);
    skip = 0;
  }
}
