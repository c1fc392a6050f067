import type { FastifyInstance } from 'fastify';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { buildApp } from '../../producer/app.js';
import { RedisKeys } from '../../shared/redis.js';
import { Client } from '../helpers/client.js';
import { configFrom, testEnv } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';

// Small chunks so a 100,000-item batch crosses many chunks and their ordering is exercised.
// Bull Board's actions on: the board's tests below use them (it is read-only by default).
const { env, admin, other, encryptOnly } = testEnv({ CHUNK_ITEMS: '7000', SYNC_MAX_ITEMS: '50', BULL_BOARD_ACTIONS: 'true' });
let app: FastifyInstance;
let worker: RunningProcess | undefined;
let client: Client;
let queuedBeforeWorker: string;
let queuedByEarlierApi: string;
const earlierItems = Array.from({ length: 7005 }, (_, i) => `earlier-${i}`);

beforeAll(async () => {
  app = await buildApp({ config: configFrom(env) });
  const address = await app.listen({ host: '127.0.0.1', port: 0 });
  client = new Client(address, admin.token);
  expect((await client.json('POST', '/v1/keys/serials')).status).toBe(201);
  // Submitted before any worker runs: it must wait, queued, with no results yet.
  const queued = await client.uploadNdjson('encrypt', 'serials', ['early-1', 'early-2']);
  queuedBeforeWorker = queued.body.batchId;
  // Two chunks queued as an API from before result records would queue them: without resultFormat.
  queuedByEarlierApi = (await client.uploadNdjson('encrypt', 'serials', earlierItems)).body.batchId;
  const jobs = (await app.services.queue.getJobs(['waiting'])).filter((j) => j.data.batchId === queuedByEarlierApi);
  expect(jobs).toHaveLength(2);
  for (const job of jobs) {
    const { resultFormat, ...earlier } = job.data;
    expect(resultFormat).toBe('records');
    await job.updateData(earlier);
  }
  worker = await startWorker(env);
});

afterAll(async () => {
  await worker?.stop();
  await app?.close();
});

const serial = (n: number) => `SER-${String(n).padStart(7, '0')}-${(n * 7919) % 100_003}`;

describe('batches', () => {
  it('holds a batch queued until a worker runs, with results refused as not ready', async () => {
    const res = await fetch(`${client.base}/v1/batches/${queuedBeforeWorker}/results`, { headers: { authorization: `Bearer ${admin.token}` } });
    // The worker may already have taken it; either it is not ready, or it completed correctly.
    if (res.status === 409) expect(((await res.json()) as any).error.code).toBe('KF_BATCH_NOT_READY');
    const done = await client.waitForBatch(queuedBeforeWorker);
    expect(done).toMatchObject({ status: 'completed', total: 2, processed: 2, succeeded: 2, failed: 0 });
  });

  it('stores NDJSON lines for the jobs of an earlier API (which streams stored results as they are), and streams them as they are', async () => {
    expect(await client.waitForBatch(queuedByEarlierApi)).toMatchObject({ status: 'completed', succeeded: earlierItems.length });
    for (const chunk of [0, 1]) {
      const stored = (await app.services.batches.readResults(queuedByEarlierApi, admin.tenant, chunk)).take()!.toString('utf8');
      const lines = stored.split('\n').filter(Boolean).map((l) => JSON.parse(l));
      expect(lines.map((l) => l.i)).toEqual(earlierItems.slice(chunk * 7000, chunk * 7000 + 7000).map((_, n) => chunk * 7000 + n));
    }
    const results = await client.results(queuedByEarlierApi);
    expect(results.map((l) => l.i)).toEqual(earlierItems.map((_, i) => i));
    expect((await client.results(queuedByEarlierApi, 6998)).map((l) => l.i)).toEqual([6998, 6999, 7000, 7001, 7002, 7003, 7004]);
    expect(await client.results(queuedByEarlierApi, 7005)).toEqual([]);
    const past = await client.json('GET', `/v1/batches/${queuedByEarlierApi}/results?from=7006`);
    expect([past.status, past.body.error]).toEqual([400, { code: 'KF_VALIDATION', message: "querystring.from: 7006 is past the batch's end (it holds 7005 items; from=7005 reads none)" }]);
    const back = await client.uploadNdjson('decrypt', 'serials', results.map((l) => l.ciphertext!));
    await client.waitForBatch(back.body.batchId);
    expect((await client.results(back.body.batchId)).map((l) => l.plaintext)).toEqual(earlierItems);
    // A batch of this API's own is stored as records.
    expect((await app.services.batches.readResults(queuedBeforeWorker, admin.tenant, 0)).take()![0]).toBe(1);
  });

  it('encrypts 100,000 NDJSON items, streams results in input order, and a second batch decrypts them all back', async () => {
    const originals = Array.from({ length: 100_000 }, (_, i) => serial(i));
    const submitted = await client.uploadNdjson('encrypt', 'serials', originals);
    expect(submitted.status).toBe(202);
    expect(submitted.body).toMatchObject({ status: 'queued', total: 100_000 });
    const done = await client.waitForBatch(submitted.body.batchId);
    expect(done).toMatchObject({ status: 'completed', total: 100_000, processed: 100_000, succeeded: 100_000, failed: 0 });
    expect(done.finishedAt).toBeTruthy();

    const sealed = await client.results(submitted.body.batchId);
    expect(sealed).toHaveLength(100_000);
    sealed.forEach((line, n) => expect(line.i).toBe(n));
    expect(new Set(sealed.map((l) => l.ciphertext)).size).toBe(100_000);

    // A client that lost its download resumes from any item, inside a chunk or on its edge.
    for (const from of [7000 * 3 + 123, 7000 * 14, 99_999, 100_000]) {
      const rest = await client.results(submitted.body.batchId, from);
      expect(rest.map((l) => l.i)).toEqual(sealed.slice(from).map((l) => l.i));
      expect(rest.map((l) => l.ciphertext)).toEqual(sealed.slice(from).map((l) => l.ciphertext));
    }

    const back = await client.uploadNdjson('decrypt', 'serials', sealed.map((l) => l.ciphertext!));
    expect((await client.waitForBatch(back.body.batchId)).succeeded).toBe(100_000);
    const opened = await client.results(back.body.batchId);
    expect(opened.map((l) => l.plaintext)).toEqual(originals);
  });

  it('fails only the bad items of a batch, in their place', async () => {
    const [good] = (await client.json('POST', '/v1/encrypt/serials', { items: ['fine'] })).body.results;
    const raw = Buffer.from(good.ciphertext.slice(6), 'base64');
    raw[20]! ^= 0x40;
    const body = [JSON.stringify(good.ciphertext), JSON.stringify(`kf:v1:${raw.toString('base64')}`), '42', '{not json', JSON.stringify(good.ciphertext.replace('kf:v1', 'kf:v9')), JSON.stringify(good.ciphertext)].join('\n');
    const res = await fetch(`${client.base}/v1/batches?op=decrypt&key=serials`, { method: 'POST', headers: { authorization: `Bearer ${admin.token}`, 'content-type': 'application/x-ndjson' }, body });
    const { batchId, total } = (await res.json()) as { batchId: string; total: number };
    expect(total).toBe(6);
    expect(await client.waitForBatch(batchId)).toMatchObject({ status: 'completed', succeeded: 2, failed: 4 });
    const lines = await client.results(batchId);
    expect(lines.map((l) => l.plaintext ?? l.error?.code)).toEqual(['fine', 'KF_DECRYPT_FAILED', 'KF_INVALID_ITEM', 'KF_INVALID_ITEM', 'KF_DECRYPT_FAILED', 'fine']);
    expect(lines[3]!.error!.message).toBe('the item is not a JSON string of well-formed UTF-8 text (nor, in a synchronous request, a valid item object)'); // '{not json': not JSON at all
  });

  it('accepts a JSON body {"items": [...]} streamed in', async () => {
    const items = Array.from({ length: 15_000 }, (_, i) => `json-${i}`);
    const res = await client.json('POST', '/v1/batches?op=encrypt&key=serials', { items: [...items.slice(0, 10), 7, ...items.slice(10)] });
    expect(res.status).toBe(202);
    expect(res.body.total).toBe(15_001);
    expect(await client.waitForBatch(res.body.batchId)).toMatchObject({ status: 'completed', succeeded: 15_000, failed: 1 });
    const lines = await client.results(res.body.batchId);
    expect(lines[10]!.error!.code).toBe('KF_INVALID_ITEM');
    expect(lines.filter((l) => l.ciphertext)).toHaveLength(15_000);
  });

  it('fails an item whose bytes are not UTF-8, or whose text has a lone surrogate, alone and in its place, in NDJSON and JSON uploads', async () => {
    // Decoded or encoded, each became U+FFFD: the batch encrypted other text than was sent.
    const FF = Buffer.from([0xff]);
    const items = [
      Buffer.from('"first"'),
      Buffer.concat([Buffer.from('"A'), FF, Buffer.from('"')]), // a plain line
      Buffer.concat([Buffer.from('"\\u0041'), FF, Buffer.from('"')]), // a line with escapes
      Buffer.from('"\\ud800"'),
      Buffer.from('"x\\udc00y"'),
      Buffer.from('"\\ud83d\\ude00"'), // a pair: one character
      Buffer.from('"last"'),
    ];
    const ndjson = Buffer.concat(items.flatMap((item) => [item, Buffer.from('\n')]));
    const json = Buffer.concat([Buffer.from('{"items":['), ...items.flatMap((item, i) => (i === 0 ? [item] : [Buffer.from(','), item])), Buffer.from(']}')]);
    for (const [type, body] of [['application/x-ndjson', ndjson], ['application/json', json]] as const) {
      for (const op of ['encrypt', 'decrypt']) {
        const res = await fetch(`${client.base}/v1/batches?op=${op}&key=serials`, { method: 'POST', headers: { authorization: `Bearer ${admin.token}`, 'content-type': type }, body });
        expect(res.status, `${type} ${op}`).toBe(202);
        const { batchId } = (await res.json()) as { batchId: string };
        await client.waitForBatch(batchId);
        const lines = await client.results(batchId);
        // Decrypt: what is not a ciphertext fails KF_DECRYPT_FAILED, as before; what cannot be read, as every route fails it.
        const readable = op === 'encrypt' ? 'ok' : 'KF_DECRYPT_FAILED';
        expect(lines.map((l) => l.error?.code ?? 'ok'), `${type} ${op}`).toEqual([readable, ...Array(4).fill('KF_INVALID_ITEM'), readable, readable]);
        if (op === 'encrypt') {
          const back = await client.json('POST', '/v1/decrypt/serials', { items: lines.filter((l) => l.ciphertext).map((l) => l.ciphertext) });
          expect(back.body.results.map((r: { plaintext: string }) => r.plaintext)).toEqual(['first', '😀', 'last']);
        }
      }
    }
  });

  it('turns a sync request above SYNC_MAX_ITEMS into a batch (202), and mode "async" always', async () => {
    const auto = await client.json('POST', '/v1/encrypt/serials', { items: Array.from({ length: 51 }, (_, i) => `auto-${i}`) });
    expect(auto.status).toBe(202);
    expect(auto.body).toMatchObject({ status: 'queued', total: 51 });
    const forced = await client.json('POST', '/v1/encrypt/serials', { items: ['one', 2, 'three'], mode: 'async' });
    expect(forced.status).toBe(202);
    expect((await client.waitForBatch(forced.body.batchId)).succeeded).toBe(2);
    const forcedResults = (await client.results(forced.body.batchId)).map((l) => l.error?.code ?? 'sealed');
    expect(forcedResults).toEqual(['sealed', 'KF_INVALID_ITEM', 'sealed']);
    const tooMany = await client.json('POST', '/v1/encrypt/serials', { items: Array.from({ length: 51 }, () => 'x'), mode: 'sync' });
    expect(tooMany.status).toBe(400);
    expect(tooMany.body.error.code).toBe('KF_SYNC_LIMIT');
    expect((await client.waitForBatch(auto.body.batchId)).succeeded).toBe(51);
    // A token with only the encrypt scope can follow the batch its request became.
    const own = new Client(client.base, encryptOnly.token);
    expect((await own.json('GET', `/v1/batches/${auto.body.batchId}`)).status).toBe(200);
  });

  it('streams progress as Server-Sent Events ending with the final status', async () => {
    const submitted = await client.uploadNdjson('encrypt', 'serials', Array.from({ length: 30_000 }, (_, i) => `sse-${i}`));
    const res = await fetch(`${client.base}/v1/batches/${submitted.body.batchId}/events`, { headers: { authorization: `Bearer ${admin.token}` } });
    expect(res.headers.get('content-type')).toMatch(/^text\/event-stream/);
    const text = await res.text(); // the server ends the stream after the final event
    const events = text.split('\n\n').filter((e) => e.startsWith('event:'));
    const last = events.at(-1)!;
    expect(last).toMatch(/^event: done\n/);
    expect(JSON.parse(last.split('data: ')[1]!)).toMatchObject({ status: 'completed', processed: 30_000 });
    for (const e of events.slice(0, -1)) expect(e).toMatch(/^event: progress\n/);
  });

  it('hides a batch from other tenants exactly as if it did not exist', async () => {
    const submitted = await client.uploadNdjson('encrypt', 'serials', ['mine']);
    const stranger = new Client(client.base, other.token);
    const foreign = await stranger.json('GET', `/v1/batches/${submitted.body.batchId}`);
    const missing = await stranger.json('GET', '/v1/batches/AAAAAAAAAAAAAAAA');
    expect(foreign.status).toBe(404);
    expect(foreign.body).toEqual(missing.body);
  });

  it('deletes a batch: results are gone and the status says so', async () => {
    const cancelledCount = async (): Promise<number> => {
      const text = await (await fetch(`${client.base}/metrics`, { headers: { authorization: `Bearer ${admin.token}` } })).text();
      return Number(/^keyfleet_batches_total\{[^}]*event="cancelled"[^}]*\} (\d+)$/m.exec(text)?.[1] ?? 0);
    };
    const cancelledBefore = await cancelledCount();
    const submitted = await client.uploadNdjson('encrypt', 'serials', ['to-delete-1', 'to-delete-2']);
    await client.waitForBatch(submitted.body.batchId);
    expect((await client.json('GET', `/v1/batches/${submitted.body.batchId}`)).body).not.toHaveProperty('resultsDeleted');
    const deleted = await client.json('DELETE', `/v1/batches/${submitted.body.batchId}`);
    expect(deleted.status).toBe(200);
    expect(deleted.body).toMatchObject({ status: 'completed', resultsDeleted: true });
    expect((await client.json('GET', `/v1/batches/${submitted.body.batchId}`)).body).toMatchObject({ status: 'completed', resultsDeleted: true });
    expect((await client.json('DELETE', `/v1/batches/${submitted.body.batchId}`)).status).toBe(200);
    // Deleting a completed batch is not a cancellation, however often it is asked.
    expect(await cancelledCount()).toBe(cancelledBefore);
    const res = await fetch(`${client.base}/v1/batches/${submitted.body.batchId}/results`, { headers: { authorization: `Bearer ${admin.token}` } });
    expect(res.status).toBe(410);
    expect(((await res.json()) as any).error.code).toBe('KF_BATCH_DELETED');

    // Results gone after the status was read (a DELETE or expiry in between, here the stored
    // results removed under a completed batch): still a 410 before any line, not a 500.
    const raced = await client.uploadNdjson('encrypt', 'serials', ['raced-1', 'raced-2']);
    await client.waitForBatch(raced.body.batchId);
    await app.services.redis.del(new RedisKeys(env['KEYFLEET_PREFIX']!).batchResult(raced.body.batchId, 0));
    const gone = await fetch(`${client.base}/v1/batches/${raced.body.batchId}/results`, { headers: { authorization: `Bearer ${admin.token}` } });
    expect(gone.status).toBe(410);
    expect(((await gone.json()) as any).error.code).toBe('KF_BATCH_DELETED');
  });

  it('takes an upload’s media type in any case, as HTTP has it', async () => {
    const res = await fetch(`${client.base}/v1/batches?op=encrypt&key=serials`, {
      method: 'POST',
      headers: { authorization: `Bearer ${admin.token}`, 'content-type': 'Application/X-NDJSON' },
      body: '"case-1"\n"case-2"\n',
    });
    expect(res.status).toBe(202);
    expect(((await res.json()) as any).total).toBe(2);
  });

  it('speaks RESP2 on every connection of the API and the worker, BullMQ’s too', async () => {
    // ioredis 6 speaks RESP3 unless told otherwise; keyfleet’s scripts and pub/sub are RESP2’s.
    // Every connection the service opens is named (keyfleet-<role>, BullMQ’s by its queue); the
    // test’s own clients are not. The worker’s BullMQ connections may still be coming up.
    const named = await vi.waitFor(async () => {
      const clients = String(await app.services.redis.client('LIST'))
        .split('\n')
        .filter((line) => / name=\S/.test(line))
        .map((line) => ({ name: / name=(\S+)/.exec(line)![1]!, resp: / resp=(\d)/.exec(line)?.[1] }));
      expect(clients.map((c) => c.name)).toEqual(expect.arrayContaining(['keyfleet-api', 'keyfleet-worker', 'keyfleet-subscriber']));
      expect(clients.filter((c) => !c.name.startsWith('keyfleet-')).length).toBeGreaterThan(0);
      return clients;
    }, { timeout: 10_000, interval: 100 });
    // CLIENT LIST names each client's protocol from Redis 7.0 on: the suite's redis-server is 7.0 or later.
    expect(named.filter((c) => c.resp !== '2')).toEqual([]);
  });

  it('hands Bull Board’s actions on, bodies included: pauses the webhook queue, adds a job to it, resumes it', async () => {
    // The board is loaded on its first request and answers through the API (plugins/admin.ts).
    const webhooks = app.services.webhookQueue;
    const api = `/admin/queues/api/queues/${encodeURIComponent(webhooks.name)}`;
    expect((await client.json('PUT', `${api}/pause`)).status).toBe(200);
    try {
      expect(await webhooks.isPaused()).toBe(true);
      const added = await client.json('POST', `${api}/add`, { name: 'board-check', data: { from: 'the board' } });
      expect(added.status).toBe(200);
      const job = (await webhooks.getJob(added.body.job.id))!;
      expect([job.name, job.data]).toEqual(['board-check', { from: 'the board' }]);
      await job.remove();
      // The API's body limit, not fastify's default 1 MiB.
      const large = await client.json('POST', `${api}/add`, { name: 'board-check', data: { pad: 'x'.repeat(1_200_000) } });
      expect(large.status).toBe(200);
      await (await webhooks.getJob(large.body.job.id))!.remove();
    } finally {
      expect((await client.json('PUT', `${api}/resume`)).status).toBe(200);
    }
    expect(await webhooks.isPaused()).toBe(false);
    expect((await client.json('PUT', '/admin/queues/api/queues/nowhere/pause')).status).toBe(404);
    // A HEAD says how long the page is, as the board does.
    const auth = { authorization: `Bearer ${admin.token}` };
    const page = await fetch(`${client.base}/admin/queues`, { headers: auth });
    const bytes = (await page.arrayBuffer()).byteLength;
    expect([page.status, bytes > 0]).toEqual([200, true]);
    const head = await fetch(`${client.base}/admin/queues`, { method: 'HEAD', headers: auth });
    expect([head.status, head.headers.get('content-length')]).toEqual([200, String(bytes)]);
  });

  it('runs no chunk job edited to another tenant’s key through the board: its batch fails, and nothing is decrypted', async () => {
    // Another tenant's secret, sealed under its own key.
    const globex = new Client(client.base, other.token);
    expect((await globex.json('POST', '/v1/keys/globex-only')).status).toBe(201);
    const sealed = await globex.json('POST', '/v1/encrypt/globex-only', { items: ['globex-secret-1'] });
    const ciphertext: string = sealed.body.results[0].ciphertext;
    // An admin of acme queues a decrypt of it under one of acme's keys, holds the queue, and
    // edits the job to name globex and its key.
    const board = `/admin/queues/api/queues/${encodeURIComponent(app.services.queue.name)}`;
    expect((await client.json('PUT', `${board}/pause`)).status).toBe(200);
    let batchId: string;
    try {
      batchId = (await client.uploadNdjson('decrypt', 'serials', [ciphertext])).body.batchId;
      const [job] = (await app.services.queue.getJobs(['waiting'])).filter((j) => j.data.batchId === batchId);
      const edited = await client.json('PATCH', `${board}/${encodeURIComponent(job!.id!)}/update-data`, { jobData: { ...job!.data, tenant: other.tenant, key: 'globex-only' } });
      expect(edited.status).toBe(200);
      expect((await app.services.queue.getJob(job!.id!))!.data).toMatchObject({ tenant: other.tenant, key: 'globex-only' });
    } finally {
      expect((await client.json('PUT', `${board}/resume`)).status).toBe(200);
    }
    const ended = await client.waitForBatch(batchId);
    expect(ended).toMatchObject({ status: 'failed', processed: 0, error: { code: 'KF_CHUNK_FAILED' } });
    expect(ended.error.message).toMatch(/does not match its batch/);
    const results = await fetch(`${client.base}/v1/batches/${batchId}/results`, { headers: { authorization: `Bearer ${admin.token}` } });
    const text = await results.text();
    expect(text).not.toContain('globex-secret-1');
    expect(text.trim().split('\n').map((l) => JSON.parse(l).error?.code)).toEqual(['KF_ITEM_NOT_PROCESSED']);
    // The secret is still there for its own tenant.
    expect((await globex.json('POST', '/v1/decrypt/globex-only', { items: [ciphertext] })).body.results).toEqual([{ plaintext: 'globex-secret-1' }]);
  });

  it('opens no batch moved to another tenant by a write to Redis: its data is sealed for its own tenant', async () => {
    const globex = new Client(client.base, other.token);
    expect((await globex.json('POST', '/v1/keys/globex-moved')).status).toBe(201);
    const sealed = await globex.json('POST', '/v1/encrypt/globex-moved', { items: ['globex-secret-2'] });
    const batchId = (await globex.uploadNdjson('decrypt', 'globex-moved', [sealed.body.results[0].ciphertext])).body.batchId;
    expect(await globex.waitForBatch(batchId)).toMatchObject({ status: 'completed', succeeded: 1 });
    // Someone who can write Redis, and holds an acme token, makes the batch acme's.
    await app.services.redis.hset(new RedisKeys(env['KEYFLEET_PREFIX']!).batch(batchId), 'tenant', admin.tenant);
    const moved = await fetch(`${client.base}/v1/batches/${batchId}/results`, { headers: { authorization: `Bearer ${admin.token}` } });
    const text = await moved.text();
    expect(text).not.toContain('globex-secret-2');
    expect(moved.status).toBe(500);
    expect(JSON.parse(text).error.code).toBe('KF_INTERNAL');
  });

  it('keeps Bull Board read-only without BULL_BOARD_ACTIONS: every action is refused, and the board still shows the queues', async () => {
    const readOnly = await buildApp({ config: configFrom({ ...env, BULL_BOARD_ACTIONS: 'false' }) });
    try {
      const viewer = new Client(await readOnly.listen({ host: '127.0.0.1', port: 0 }), admin.token);
      const chunks = `/admin/queues/api/queues/${encodeURIComponent(app.services.queue.name)}`;
      const webhooks = `/admin/queues/api/queues/${encodeURIComponent(app.services.webhookQueue.name)}`;
      const before = await app.services.queue.getJobCounts();
      const [done] = await app.services.queue.getJobs(['completed'], 0, 0);
      const refused = [
        await viewer.json('PUT', `${chunks}/pause`),
        await viewer.json('PUT', `${webhooks}/pause`),
        await viewer.json('POST', `${chunks}/add`, { name: 'board-check', data: {} }),
        await viewer.json('PUT', `${chunks}/clean/completed`),
        await viewer.json('PUT', `${chunks}/empty`),
        await viewer.json('PATCH', `${chunks}/${encodeURIComponent(done!.id!)}/update-data`, { jobData: { ...done!.data, tenant: 'someone-else' } }),
        await viewer.json('PUT', `${chunks}/${encodeURIComponent(done!.id!)}/clean`),
      ];
      expect(refused.map((r) => r.status)).toEqual(refused.map(() => 405));
      expect([await app.services.queue.isPaused(), await app.services.webhookQueue.isPaused()]).toEqual([false, false]);
      expect((await app.services.queue.getJob(done!.id!))!.data).toEqual(done!.data);
      expect((await app.services.queue.getJobCounts()).completed).toBeGreaterThanOrEqual(before.completed!);
      const shown = await viewer.json('GET', '/admin/queues/api/queues?activeQueue=chunks&status=completed&page=1&jobsPerPage=5');
      expect(shown.status).toBe(200);
      expect(shown.body.queues.map((q: { name: string; readOnlyMode: boolean }) => [q.name, q.readOnlyMode])).toEqual(
        expect.arrayContaining([[app.services.queue.name, true], [app.services.webhookQueue.name, true]]),
      );
    } finally {
      await readOnly.close();
    }
  });

  it('rejects uploads for unknown keys and empty uploads with clear errors', async () => {
    const unknown = await client.uploadNdjson('encrypt', 'no-such-key', ['a']);
    expect(unknown.status).toBe(404);
    expect(unknown.body.error).toEqual({ code: 'KF_KEY_NOT_FOUND', message: 'no key named "no-such-key"' });
    const empty = await client.uploadNdjson('encrypt', 'serials', []);
    expect(empty.status).toBe(400);
    const badOp = await client.uploadNdjson('explode', 'serials', ['a']);
    expect(badOp.status).toBe(400);
    expect(badOp.body.error.code).toBe('KF_VALIDATION');
  });
});
