import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import { createHash, randomBytes } from 'node:crypto';
import { request as httpRequest } from 'node:http';
import { connect } from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';
import { Writable } from 'node:stream';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { z } from 'zod';
import { IdempotencyStore, pendingMs } from '../../producer/idempotency.js';
import { EXCHANGE_MS } from '../../producer/plugins/rate-limit.js';
import { AtRestSealer } from '../../shared/at-rest.js';
import { chunkJobId } from '../../shared/queue.js';
import { createLogger } from '../../shared/logger.js';
import { RedisKeys } from '../../shared/redis.js';
import { buildApp } from '../../producer/app.js';
import { call, TestApis } from '../helpers/apps.js';
import { bearer, configFrom, testEnv, type TestTenant } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';

// Each describe gets its own environment (prefix, master key, tokens) and its own limits.
const apis = new TestApis();
const api = (env: Record<string, string>) => apis.start(env);
const redis = new Redis(testEnv().env['REDIS_URL']!);
afterAll(async () => {
  await apis.close();
  await redis.quit();
});

const ndjson = (items: string[]) => items.map((i) => JSON.stringify(i)).join('\n') + '\n';
const upload = (app: FastifyInstance, who: TestTenant, op: string, items: string[], headers: Record<string, string> = {}) =>
  call(app, who, 'POST', `/v1/batches?op=${op}&key=serials`, ndjson(items), { 'content-type': 'application/x-ndjson', ...headers });

/** Every string value stored under a prefix, raw bytes as latin1, to search for leaked plaintexts. */
async function dumpPrefix(prefix: string): Promise<string> {
  const keys = await redis.keys(`${prefix}*`);
  const parts: string[] = [];
  for (const key of keys) {
    const type = await redis.type(key);
    if (type === 'string') parts.push((await redis.getBuffer(key))?.toString('latin1') ?? '');
    if (type === 'hash') parts.push(...Object.values(await redis.hgetallBuffer(key)).map((v) => v.toString('latin1')));
    if (type === 'list') parts.push(...(await redis.lrangeBuffer(key, 0, -1)).map((v) => v.toString('latin1')));
  }
  return parts.join('\n');
}

describe('limits', () => {
  const { env, admin, other } = testEnv({ MAX_BATCH_ITEMS: '100', MAX_ACTIVE_BATCHES: '2', MAX_ITEM_BYTES: '64', SYNC_MAX_ITEMS: '10', MAX_BODY_BYTES: '4096' });
  let app: FastifyInstance;
  beforeAll(async () => {
    app = await api(env);
    for (const who of [admin, other]) expect((await call(app, who, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
  });
  /** The API on a loopback port, for the tests that need a real socket. */
  const listening = async (): Promise<URL> => {
    if (!app.server.listening) await app.listen({ host: '127.0.0.1', port: 0 });
    return new URL(`http://127.0.0.1:${(app.server.address() as { port: number }).port}`);
  };

  it('refuses . and .. as key names, which clients resolve out of a URL path before sending it', async () => {
    const url = await listening();
    // Sent as is (curl --path-as-is): no client library would send these paths.
    const post = (path: string) =>
      new Promise<{ status: number; body: string }>((resolve, reject) => {
        const req = httpRequest({ host: url.hostname, port: url.port, method: 'POST', path, headers: bearer(admin) }, (res) => {
          let body = '';
          res.setEncoding('utf8').on('data', (piece: string) => (body += piece));
          res.on('end', () => resolve({ status: res.statusCode!, body }));
        });
        req.on('error', reject).end();
      });
    for (const path of ['/v1/keys/.', '/v1/keys/..', '/v1/keys/%2E%2E']) {
      const res = await post(path);
      expect(res.status, path).toBe(400);
      expect(JSON.parse(res.body).error, path).toEqual({ code: 'KF_VALIDATION', message: 'params.name: expected 1-128 characters of [A-Za-z0-9._-], not . or ..' });
    }
    for (const name of ['..a', '.hidden', 'a.']) expect((await post(`/v1/keys/${name}`)).status, name).toBe(201);
    // One made before the rule stays usable: by a query or a body, or a raw path.
    await app.services.keyStore.create('acme', '..', { type: 'aes256-gcm96' });
    const sealed = await call(app, admin, 'POST', '/v1/batches?op=encrypt&key=..', '"x"\n', { 'content-type': 'application/x-ndjson' });
    expect(sealed.statusCode).toBe(202);
    await call(app, admin, 'DELETE', `/v1/batches/${sealed.json().batchId}`);
  });

  it('refuses a body above MAX_BODY_BYTES with 413, and more items than SYNC_MAX_ITEMS in a sync request with 400', async () => {
    const big = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['x'.repeat(5000)] });
    expect(big.statusCode).toBe(413);
    expect(big.json().error.code).toBe('KF_PAYLOAD_TOO_LARGE');
    const many = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: Array(11).fill('x'), mode: 'sync' });
    expect(many.statusCode).toBe(400);
    expect(many.json().error).toMatchObject({ code: 'KF_SYNC_LIMIT', message: expect.stringContaining('at most 10') });
  });

  it('fails only the item above MAX_ITEM_BYTES, and an NDJSON line too long to be one, in their places', async () => {
    const res = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['ok', 'y'.repeat(65), 'fine'] });
    expect(res.json().results.map((r: any) => r.error?.code ?? 'ok')).toEqual(['ok', 'KF_ITEM_TOO_LARGE', 'ok']);
    const batch = await upload(app, admin, 'encrypt', ['a', 'z'.repeat(2000), 'b']);
    expect(batch.statusCode).toBe(202);
    expect(batch.json().total).toBe(3);
    await call(app, admin, 'DELETE', `/v1/batches/${batch.json().batchId}`);
  });

  it('measures a sync item in UTF-8 bytes against MAX_ITEM_BYTES, in characters of one to four bytes', async () => {
    // At most 64 bytes each (63 for the euros: the one item short enough to go unmeasured), then each one character longer.
    const fit = ['y'.repeat(64), 'é'.repeat(32), '€'.repeat(21), '😀'.repeat(16)];
    const over = ['y'.repeat(65), 'é'.repeat(33), '€'.repeat(22), '😀'.repeat(17)];
    const res = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: [...fit, ...over] });
    const results = res.json().results as Array<{ ciphertext?: string; error?: { code: string } }>;
    expect(results.map((r) => r.error?.code ?? 'ok')).toEqual([...fit.map(() => 'ok'), ...over.map(() => 'KF_ITEM_TOO_LARGE')]);
    const opened = await call(app, admin, 'POST', '/v1/decrypt/serials', { items: results.slice(0, fit.length).map((r) => r.ciphertext) });
    expect(opened.json().results.map((r: { plaintext: string }) => r.plaintext)).toEqual(fit);
  });

  it('refuses a batch of more than MAX_BATCH_ITEMS with 413, and that batch never runs (it counts as failed)', async () => {
    const failed = async () => Number(/^keyfleet_batches_total\{event="failed"[^}]*\} (\d+)$/m.exec((await app.inject('/metrics')).body)?.[1] ?? 0);
    const before = await failed();
    const res = await upload(app, admin, 'encrypt', Array.from({ length: 101 }, (_, i) => `S-${i}`));
    expect(res.statusCode).toBe(413);
    expect(res.json().error).toMatchObject({ code: 'KF_BATCH_TOO_LARGE', message: expect.stringContaining('100') });
    expect(await failed()).toBe(before + 1);
  });

  it('reads and drops the rest of an upload refused part-way, so a client that sends its whole body before reading gets the 413', async () => {
    // As clients that write the request before reading the answer do (Python's http.client, for
    // one): 8 MB, refused after 100 items. An answer alone would leave those bytes unread: the
    // server stops reading once its buffers fill, the write never ends, and the connection is
    // reset under it.
    const address = await listening();
    const body = Buffer.from(`"${'S'.repeat(30)}"\n`.repeat(250_000));
    const head = `POST /v1/batches?op=encrypt&key=serials HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${admin.token}\r\nContent-Type: application/x-ndjson\r\nContent-Length: ${body.length}\r\n\r\n`;
    const outcome = await new Promise<{ written: boolean; error?: string; answer: string }>((resolve) => {
      let answer = '';
      let written = false;
      let error: string | undefined;
      const socket = connect(Number(address.port), '127.0.0.1', () => socket.write(Buffer.concat([Buffer.from(head), body]), (err) => (written = !err)));
      socket.setEncoding('latin1').on('data', (d) => (answer += d));
      socket.on('error', (err: NodeJS.ErrnoException) => (error = err.code ?? err.message)).on('close', () => resolve({ written, ...(error ? { error } : {}), answer }));
      setTimeout(() => socket.destroy(), 20_000).unref();
    });
    expect(outcome.error).toBeUndefined();
    expect(outcome.written).toBe(true);
    expect(outcome.answer).toMatch(/^HTTP\/1\.1 413 /);
    expect(outcome.answer).toMatch(/connection: close/i);
    expect(outcome.answer).toContain('"code":"KF_BATCH_TOO_LARGE"');
  });

  it('does not run a request sent behind an upload refused part-way, even in the same read as the body’s end', async () => {
    const address = await listening();
    const lines = Buffer.from(`"${'P'.repeat(30)}"\n`.repeat(200)); // refused at the 101st
    const rest = Buffer.from(`"${'P'.repeat(30)}"\n`.repeat(50));
    const head = `POST /v1/batches?op=encrypt&key=serials HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${admin.token}\r\nContent-Type: application/x-ndjson\r\nContent-Length: ${lines.length + rest.length}\r\n\r\n`;
    const behind = `POST /v1/keys/pipelined HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${admin.token}\r\nContent-Length: 0\r\n\r\n`;
    const answer = await new Promise<string>((resolve) => {
      let received = '';
      const socket = connect({ port: Number(address.port), host: '127.0.0.1', allowHalfOpen: true }, () => socket.write(Buffer.concat([Buffer.from(head), lines])));
      socket.setEncoding('latin1').on('data', (d) => {
        // The answer is in: the rest of the body, and a request behind it, in one write.
        if (!received) socket.write(Buffer.concat([rest, Buffer.from(behind)]));
        received += d;
      });
      socket.on('error', () => {}).on('close', () => resolve(received));
      setTimeout(() => socket.destroy(), 10_000).unref();
    });
    expect(answer).toMatch(/^HTTP\/1\.1 413 /);
    expect(answer.match(/HTTP\/1\.1/g)).toHaveLength(1);
    expect((await call(app, admin, 'GET', '/v1/keys/pipelined')).statusCode).toBe(404);
  });

  it('allows MAX_ACTIVE_BATCHES batches queued at once per tenant: the next is 429, other tenants are unaffected, and a slot frees when one ends', async () => {
    const first = await upload(app, admin, 'encrypt', ['a']);
    const second = await upload(app, admin, 'encrypt', ['b']);
    expect([first.statusCode, second.statusCode]).toEqual([202, 202]);
    const third = await upload(app, admin, 'encrypt', ['c']);
    expect(third.statusCode).toBe(429);
    expect(third.json().error.code).toBe('KF_TOO_MANY_BATCHES');
    expect(Number(third.headers['retry-after'])).toBeGreaterThan(0);
    expect((await upload(app, other, 'encrypt', ['d'])).statusCode).toBe(202);
    await call(app, admin, 'DELETE', `/v1/batches/${first.json().batchId}`);
    expect((await upload(app, admin, 'encrypt', ['e'])).statusCode).toBe(202);
  });

  it('refuses query parameters a route does not take, and bodies that are not JSON, instead of ignoring them', async () => {
    // A mistyped context (ctx=) must not make a batch without one.
    const typo = await call(app, admin, 'POST', '/v1/batches?op=encrypt&key=serials&ctx=tenant%3Dacme', ndjson(['a']), { 'content-type': 'application/x-ndjson' });
    expect(typo.statusCode).toBe(400);
    expect(typo.json().error).toEqual({ code: 'KF_VALIDATION', message: expect.stringContaining('ctx') });
    const onSync = await call(app, admin, 'POST', '/v1/encrypt/serials?mode=sync', { items: ['a'] });
    expect(onSync.statusCode).toBe(400);
    expect(onSync.json().error).toEqual({ code: 'KF_VALIDATION', message: 'querystring: unrecognized parameter(s) "mode"' });
    expect((await call(app, admin, 'GET', '/v1/keys/serials?verbose=1')).statusCode).toBe(400);
    // Parameters a route does take still work.
    expect((await call(app, admin, 'GET', '/v1/keys/serials')).statusCode).toBe(200);
    const plain = await call(app, admin, 'POST', '/v1/encrypt/serials', 'LIC-1', { 'content-type': 'text/plain' });
    expect(plain.statusCode).toBe(415);
    expect(plain.json().error).toEqual({ code: 'KF_UNSUPPORTED_MEDIA_TYPE', message: 'expected application/json' });
    // NDJSON is for uploads; the upload's refusal names both types it takes.
    const lines = await call(app, admin, 'POST', '/v1/encrypt/serials', ndjson(['a']), { 'content-type': 'application/x-ndjson' });
    expect([lines.statusCode, lines.json().error.message]).toEqual([415, 'expected application/json']);
    const upload = await call(app, admin, 'POST', '/v1/batches?op=encrypt&key=serials', 'a', { 'content-type': 'text/plain' });
    expect(upload.json().error).toEqual({ code: 'KF_UNSUPPORTED_MEDIA_TYPE', message: 'expected application/json or application/x-ndjson' });
    const untyped = await call(app, admin, 'POST', '/v1/batches?op=encrypt&key=serials');
    expect([untyped.statusCode, untyped.json().error.message]).toEqual([415, 'expected application/json or application/x-ndjson']);
    // A parameter left out is named as required; an enum's, with its values.
    const noOp = await call(app, admin, 'POST', '/v1/batches?key=serials', ndjson(['a']), { 'content-type': 'application/x-ndjson' });
    expect(noOp.json().error).toEqual({ code: 'KF_VALIDATION', message: 'querystring.op: required: one of "encrypt", "decrypt", "rewrap"' });
    const noKey = await call(app, admin, 'POST', '/v1/batches?op=encrypt', ndjson(['a']), { 'content-type': 'application/x-ndjson' });
    expect(noKey.json().error).toEqual({ code: 'KF_VALIDATION', message: 'querystring.key: required' });
    expect((await call(app, admin, 'POST', '/v1/encrypt/serials', {})).json().error).toEqual({ code: 'KF_VALIDATION', message: 'body.items: required' });
    // A field at the top of the body is named without a stray dot.
    const field = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['a'], typo: 1 });
    expect(field.statusCode).toBe(400);
    expect(field.json().error.message).toMatch(/^body: /);
  });

  it('answers a route asked with a method it does not take 405 with Allow, and a path no route has 404', async () => {
    for (const [method, url, allow] of [
      ['PUT', '/v1/keys/serials', 'DELETE, GET, HEAD, PATCH, POST'],
      ['DELETE', '/v1/keys', 'GET, HEAD'],
      ['GET', '/v1/encrypt/serials?mode=sync', 'POST'],
      ['PATCH', '/v1/batches/abcdefgh', 'DELETE, GET, HEAD'],
      ['POST', '/healthz', 'GET, HEAD'],
    ] as const) {
      const res = await call(app, admin, method, url);
      expect(res.statusCode, `${method} ${url}`).toBe(405);
      expect(res.headers['allow'], `${method} ${url}`).toBe(allow);
      expect(res.json().error, `${method} ${url}`).toEqual({ code: 'KF_METHOD_NOT_ALLOWED', message: expect.any(String) });
    }
    for (const url of ['/v1/key/serials', '/v1/keys/serials/versions', '/v2/keys']) {
      const res = await call(app, admin, 'PUT', url);
      expect(res.statusCode, url).toBe(404);
      expect(res.headers['allow'], url).toBeUndefined();
      expect(res.json().error.code, url).toBe('KF_NOT_FOUND');
    }
    // As a missing route: the token first.
    expect((await app.inject({ method: 'PUT', url: '/v1/keys/serials' })).statusCode).toBe(401);
  });

  it('refuses a __proto__ or constructor key at the top of a JSON body as any unknown key, and fails an item object with one alone', async () => {
    for (const key of ['__proto__', 'constructor']) {
      const bodies = { '/v1/encrypt/serials': '{"items":["a"],', '/v1/keys/other-key': '{"type":"aes256-gcm96",' };
      for (const [url, start] of Object.entries(bodies)) {
        const res = await call(app, admin, 'POST', url, `${start}"${key}":{"polluted":true}}`, { 'content-type': 'application/json' });
        expect(res.statusCode).toBe(400);
        expect(res.json().error).toEqual({ code: 'KF_VALIDATION', message: `body: Unrecognized key: "${key}"` });
      }
    }
    const item = await call(app, admin, 'POST', '/v1/encrypt/serials', '{"items":["a",{"plaintext":"b","__proto__":{"polluted":true}},"c"]}', { 'content-type': 'application/json' });
    expect(item.json().results.map((r: any) => r.error?.code ?? 'ok')).toEqual(['ok', 'KF_INVALID_ITEM', 'ok']);
    expect(({} as Record<string, unknown>)['polluted']).toBeUndefined();
  });

  it('refuses, as it is added, a route whose JSON body schema would take keys it does not name', async () => {
    const fresh = await buildApp({ config: configFrom(env) });
    try {
      const handler = async () => ({});
      expect(() => fresh.post('/v1/loose', { schema: { body: z.object({ a: z.string() }) } }, handler)).toThrow(/POST \/v1\/loose: a JSON body's schema must be a strict object/);
      expect(() => fresh.post('/v1/loose-nullish', { schema: { body: z.looseObject({ a: z.string() }).nullish() } }, handler)).toThrow(/strict object/);
      expect(() => fresh.post('/v1/strict', { schema: { body: z.object({ a: z.string() }).strict().nullish() } }, handler)).not.toThrow();
    } finally {
      await fresh.close();
    }
  });

  it('makes batches under an UPLOAD_IDLE_SECONDS that is no multiple of 3 (the upload lease in whole milliseconds)', async () => {
    // A third of 5 s is no whole number of milliseconds, and Redis takes none other for PX.
    const idle = testEnv({ UPLOAD_IDLE_SECONDS: '5' });
    const idleApp = await api(idle.env);
    expect((await call(idleApp, idle.admin, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
    const uploaded = await upload(idleApp, idle.admin, 'encrypt', ['a', 'b']);
    expect(uploaded.statusCode, uploaded.body).toBe(202);
    const queued = await call(idleApp, idle.admin, 'POST', '/v1/encrypt/serials', { items: ['x'], mode: 'async' });
    expect(queued.statusCode, queued.body).toBe(202);
    // While an upload is held open its lease lives: 5 s and twice a third of them, in whole ms.
    const address = new URL(await idleApp.listen({ host: '127.0.0.1', port: 0 }));
    const socket = connect(Number(address.port), '127.0.0.1', () =>
      socket.write(`POST /v1/batches?op=encrypt&key=serials HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${idle.admin.token}\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n"a"\n\r\n`),
    );
    socket.on('error', () => {});
    try {
      let leases: string[] = [];
      for (let i = 0; i < 50 && leases.length === 0; i++, await sleep(20)) leases = await redis.keys(`${idle.env['KEYFLEET_PREFIX']}:batch:*:upload`);
      expect(leases).toHaveLength(1);
      const lease = await redis.pttl(leases[0]!);
      expect(lease).toBeGreaterThan(0);
      expect(lease).toBeLessThanOrEqual(5_000 + 2 * 1_666);
    } finally {
      socket.destroy();
    }
  });

  it('fails an upload or a JSON body that sends nothing for UPLOAD_IDLE_SECONDS with 408 (and the upload’s batch), not one that keeps coming', async () => {
    const idle = testEnv({ UPLOAD_IDLE_SECONDS: '3' });
    const idleApp = await api(idle.env);
    expect((await call(idleApp, idle.admin, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
    const address = await idleApp.listen({ host: '127.0.0.1', port: 0 });
    // Writes `pieces` one per second (then ends), or, with `quiet`, the first piece only and
    // then goes quiet (and would stay so for 20 s).
    const send = (path: string, contentType: string, pieces: string[], quiet: boolean) =>
      new Promise<{ status: number; body: string; connection: string | undefined }>((resolve, reject) => {
        const length = Buffer.byteLength(pieces.join(''));
        const req = httpRequest(`${address}${path}`, { method: 'POST', headers: { authorization: `Bearer ${idle.admin.token}`, 'content-type': contentType, 'content-length': length } }, (res) => {
          let body = '';
          res.setEncoding('utf8').on('data', (d) => (body += d)).on('end', () => resolve({ status: res.statusCode!, body, connection: res.headers.connection }));
        });
        req.on('error', reject);
        const timers = (quiet ? [[20_000, pieces.slice(1).join('')] as const] : pieces.slice(1).map((piece, n) => [1_000 * (n + 1), piece] as const))
          .map(([after, piece], n, all) => setTimeout(() => (n === all.length - 1 ? req.end(piece) : req.write(piece)), after));
        req.write(pieces[0]);
        req.on('close', () => timers.forEach(clearTimeout));
      });
    // A request answered without its body (DELETE takes none): the body, stalled, only holds
    // the connection, which closes. Resolves with the answer's status and when the socket closed.
    const toDelete = (await call(idleApp, idle.admin, 'POST', '/v1/encrypt/serials', { items: ['x'], mode: 'async' })).json().batchId;
    const answeredThenHeld = () =>
      new Promise<{ status: number; closedAfterMs: number }>((resolve, reject) => {
        const opened = Date.now();
        let received = '';
        const socket = connect(Number(new URL(address).port), '127.0.0.1', () =>
          socket.write(`DELETE /v1/batches/${toDelete} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${idle.admin.token}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"a": `),
        );
        socket.setEncoding('utf8').on('data', (d) => (received += d));
        socket.on('error', reject).on('close', () => resolve({ status: Number(/^HTTP\/1\.1 (\d+)/.exec(received)?.[1]), closedAfterMs: Date.now() - opened }));
        setTimeout(() => socket.destroy(), 20_000).unref();
      });
    const started = Date.now();
    const [upload, stalled, steady, unrouted, held] = await Promise.all([
      send('/v1/batches?op=encrypt&key=serials', 'application/x-ndjson', ['"a"\n"b"\n"c', '"\n'], true),
      send('/v1/encrypt/serials', 'application/json', ['{"items": ["a", ', '"b"]}'], true),
      // Five seconds in all, never three without a byte.
      send('/v1/encrypt/serials', 'application/json', ['{"items": [', '"a", ', '"b", ', '"c", ', '"d", ', '"e"]}'], false),
      // fastify reads the body of a request no route takes, too.
      send('/v1/no-such-route', 'application/json', ['{"items": ["a", ', '"b"]}'], true),
      answeredThenHeld(),
    ]);
    expect(unrouted.status).toBe(408);
    expect(unrouted.connection).toBe('close');
    expect(held.status).toBe(200);
    expect(held.closedAfterMs).toBeGreaterThanOrEqual(2_900);
    expect(held.closedAfterMs).toBeLessThan(15_000);
    expect(upload.status).toBe(408);
    expect(JSON.parse(upload.body).error).toEqual({ code: 'KF_REQUEST_TIMEOUT', message: 'the upload sent nothing for 3 s (UPLOAD_IDLE_SECONDS)' });
    expect(upload.connection).toBe('close');
    expect(stalled.status).toBe(408);
    expect(JSON.parse(stalled.body).error).toEqual({ code: 'KF_REQUEST_TIMEOUT', message: 'the request body sent nothing for 3 s (UPLOAD_IDLE_SECONDS)' });
    expect(stalled.connection).toBe('close');
    expect(steady.status).toBe(200);
    expect(JSON.parse(steady.body).results).toHaveLength(5);
    expect(Date.now() - started).toBeLessThan(15_000);
    const prefix = idle.env['KEYFLEET_PREFIX']!;
    const [batchId] = (await redis.smembers(`${prefix}:tenant:acme:batches`)).filter((id) => id !== toDelete);
    const status = await call(idleApp, idle.admin, 'GET', `/v1/batches/${batchId}`);
    expect(status.json()).toMatchObject({ status: 'failed', error: { code: 'KF_REQUEST_TIMEOUT' } });
  });
});

/** A sync encrypt to the API on `port` whose body is `bytes` long, of which `sent` are written at once; the rest with `finish()`. */
function slowEncrypt(port: number, token: string, bytes: number, sent: number): { answer: Promise<string>; finish: () => void; drop: () => void } {
  const items = JSON.stringify({ items: ['x'.repeat(bytes - 14)] }); // {"items":["…"]} is 14 more
  expect(items.length).toBe(bytes);
  const head = `POST /v1/encrypt/serials HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${token}\r\nContent-Type: application/json\r\nContent-Length: ${bytes}\r\nConnection: close\r\n\r\n`;
  const socket = connect(port, '127.0.0.1', () => socket.write(head + items.slice(0, sent)));
  const answer = new Promise<string>((resolve) => {
    let text = '';
    socket.setEncoding('latin1').on('data', (d) => (text += d));
    socket.on('error', () => {}).on('close', () => resolve(text));
    setTimeout(() => socket.destroy(), 20_000).unref();
  });
  return { answer, finish: () => void socket.write(items.slice(sent)), drop: () => void socket.destroy() };
}

const statusOf = (answer: string): number => Number(/^HTTP\/1\.1 (\d{3})/.exec(answer)?.[1]);

describe('request bodies held at once', () => {
  // One API may hold 1.5 MiB of bodies: one of 1,000,000 bytes arriving leaves room for small
  // ones, not for another of 600,000. One tenant may hold all of it here (its share is below).
  const inFlight = String(1.5 * 1024 * 1024);
  const { env, admin } = testEnv({ MAX_BODY_BYTES: '1048576', MAX_BODY_BYTES_IN_FLIGHT: inFlight, MAX_TENANT_BODY_BYTES_IN_FLIGHT: inFlight });
  let port: number;
  beforeAll(async () => {
    const app = await api(env);
    port = Number(new URL(await app.listen({ host: '127.0.0.1', port: 0 })).port);
    expect((await call(app, admin, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
  });

  const slowRequest = (bytes: number, sent: number) => slowEncrypt(port, admin.token, bytes, sent);

  it('answers 503 KF_BUSY with Retry-After, before reading it, to a body that would pass MAX_BODY_BYTES_IN_FLIGHT, and takes it once the room is back', async () => {
    const large = slowRequest(1_000_000, 1_000);
    await sleep(200); // its headers are in: 1,000,000 bytes held
    const refused = await slowRequest(600_000, 0).answer;
    expect(statusOf(refused)).toBe(503);
    expect(refused).toMatch(/retry-after: 1\r\n/i);
    expect(refused).toContain('"code":"KF_BUSY"');
    expect(statusOf(await slowRequest(1_000, 1_000).answer)).toBe(200); // small ones fit beside it
    large.finish();
    expect(statusOf(await large.answer)).toBe(200);
    expect(statusOf(await slowRequest(600_000, 600_000).answer)).toBe(200);
  });

  /** A sync encrypt with a chunked body of `bytes`, sent in pieces of 64 KB; with `endLater`, its last chunk (empty) 300 ms after. */
  function chunkedRequest(bytes: number, endLater = false): Promise<string> {
    const items = JSON.stringify({ items: ['x'.repeat(bytes - 14)] });
    const head = `POST /v1/encrypt/serials HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ${admin.token}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n`;
    let body = '';
    for (let at = 0; at < items.length; at += 65_536) {
      const piece = items.slice(at, at + 65_536);
      body += `${piece.length.toString(16)}\r\n${piece}\r\n`;
    }
    return new Promise<string>((resolve) => {
      let text = '';
      const end = '0\r\n\r\n';
      const socket = connect(port, '127.0.0.1', () => socket.write(endLater ? head + body : head + body + end));
      if (endLater) setTimeout(() => socket.write(end), 300).unref();
      socket.setEncoding('latin1').on('data', (d) => (text += d));
      socket.on('error', () => {}).on('close', () => resolve(text));
      setTimeout(() => socket.destroy(), 20_000).unref();
    });
  }

  it('counts a chunked body as it arrives: small ones pass beside a large body, one that passes the bound fails KF_BUSY', async () => {
    const large = slowRequest(1_000_000, 1_000);
    await sleep(200);
    // Counted at MAX_BODY_BYTES each before they arrived, any of these was refused.
    const small = await Promise.all(Array.from({ length: 5 }, () => chunkedRequest(2_000)));
    expect(small.map(statusOf)).toEqual([200, 200, 200, 200, 200]);
    const over = await chunkedRequest(700_000);
    expect(statusOf(over)).toBe(503);
    expect(over).toContain('"code":"KF_BUSY"');
    large.finish();
    expect(statusOf(await large.answer)).toBe(200);
    expect(statusOf(await chunkedRequest(700_000))).toBe(200);
  });

  it('counts a chunked body that came in with its headers, in one read, from its first byte: past the bound it is refused, and its room comes back', async () => {
    // 1,000,000 and 560,000 bytes held leave 12,864 of the 1.5 MiB.
    const large = slowRequest(1_000_000, 1_000);
    const second = slowRequest(560_000, 1_000);
    const again = { drop: () => {} };
    try {
      await sleep(200);
      // Each is written at once with its headers, so the whole body is in before the body watch runs.
      expect(statusOf(await chunkedRequest(2_000))).toBe(200);
      const over = await chunkedRequest(30_000);
      expect(statusOf(over)).toBe(503);
      expect(over).toContain('"code":"KF_BUSY"');
      // Its bytes in, its end not yet: counted as well.
      const unended = await chunkedRequest(30_000, true);
      expect(statusOf(unended)).toBe(503);
      expect(unended).toContain('"code":"KF_BUSY"');
      second.finish();
      expect(statusOf(await second.answer)).toBe(200);
      expect(statusOf(await chunkedRequest(30_000))).toBe(200);
      large.finish();
      expect(statusOf(await large.answer)).toBe(200);
      await sleep(200);
      // Nothing stayed counted: 1,000,000 and 560,000 fit again.
      const held = slowRequest(1_000_000, 1_000);
      again.drop = held.drop;
      await sleep(200);
      expect(statusOf(await slowRequest(560_000, 560_000).answer)).toBe(200);
      held.finish();
      expect(statusOf(await held.answer)).toBe(200);
    } finally {
      // A failure above leaves no body held for the next test.
      for (const request of [large, second, again]) request.drop();
      await sleep(200);
    }
  });

  it('gives the room back when a client goes away before its body is in', async () => {
    const gone = slowRequest(1_000_000, 1_000);
    await sleep(200);
    expect(statusOf(await slowRequest(600_000, 0).answer)).toBe(503);
    gone.drop();
    await gone.answer;
    await sleep(200);
    expect(statusOf(await slowRequest(600_000, 600_000).answer)).toBe(200);
  });
});

describe('one tenant’s share of the bodies held at once', () => {
  // 1.5 MiB in flight, half of it (the default share) for any one tenant.
  const { env, admin, other } = testEnv({ MAX_BODY_BYTES: '1048576', MAX_BODY_BYTES_IN_FLIGHT: String(1.5 * 1024 * 1024) });
  const logLines: string[] = [];
  let port: number;
  beforeAll(async () => {
    const sink = new Writable({ write: (chunk, _enc, done) => (logLines.push(String(chunk)), done()) });
    const app = await apis.start(env, createLogger({ level: 'info', name: 'shares', destination: sink }));
    port = Number(new URL(await app.listen({ host: '127.0.0.1', port: 0 })).port);
    for (const who of [admin, other]) expect((await call(app, who, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
  });

  it('keeps a tenant whose bodies come slowly from taking the room of the others: its next body is refused, theirs pass', async () => {
    // acme sends 700,000 and 600,000 bytes a trickle at a time: together within the API's 1.5
    // MiB, and so, counted for the API alone, they left another tenant no room for 300,000.
    const held = [slowEncrypt(port, admin.token, 700_000, 1_000)];
    try {
      await sleep(200);
      held.push(slowEncrypt(port, admin.token, 600_000, 1_000));
      const second = await held[1]!.answer;
      expect(statusOf(second)).toBe(503);
      expect(second).toContain(`"code":"KF_BUSY","message":"the tenant's requests hold as many request bodies as one tenant may at once on this API; retry shortly"`);
      // Refused again and again, as a client that keeps trying is: one log line, naming the tenant.
      const again = await Promise.all(Array.from({ length: 5 }, () => slowEncrypt(port, admin.token, 600_000, 0).answer));
      expect(again.map(statusOf)).toEqual([503, 503, 503, 503, 503]);
      const refusals = logLines.map((line) => JSON.parse(line)).filter((line) => line.code === 'KF_BUSY');
      expect(refusals).toEqual([expect.objectContaining({ level: 50, msg: 'request refused: request bodies held at once', tenant: admin.tenant })]);
      const theirs = await Promise.all([slowEncrypt(port, other.token, 300_000, 300_000).answer, slowEncrypt(port, other.token, 400_000, 400_000).answer]);
      expect(theirs.map(statusOf)).toEqual([200, 200]);
      // Its own small requests still pass beside its one large body, within its share.
      expect(statusOf(await slowEncrypt(port, admin.token, 50_000, 50_000).answer)).toBe(200);
      held[0]!.finish();
      expect(statusOf(await held[0]!.answer)).toBe(200);
      await sleep(200);
      // Its share is back: the 600,000 passes now.
      expect(statusOf(await slowEncrypt(port, admin.token, 600_000, 600_000).answer)).toBe(200);
    } finally {
      for (const request of held) request.drop();
      await sleep(200);
    }
  });
});

describe('query strings', () => {
  const { env, admin } = testEnv();
  let app: FastifyInstance;
  beforeAll(async () => {
    app = await api(env);
    expect((await call(app, admin, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
  });
  const uploadWith = (query: string) => call(app, admin, 'POST', `/v1/batches?op=encrypt&key=serials&${query}`, ndjson(['a']), { 'content-type': 'application/x-ndjson' });

  it('refuses a query value with a malformed percent-escape, naming the parameter but not the value, and makes no batch', async () => {
    // fastify's parser keeps such a value as its literal text: %FF would have become the context.
    for (const context of ['%FF', '100%', 'acme%2', '%E2%82']) {
      const refused = await uploadWith(`context=${context}`);
      expect(refused.statusCode).toBe(400);
      expect(refused.json().error).toEqual({ code: 'KF_VALIDATION', message: 'querystring: parameter "context" holds a malformed percent-escape (expected %XX escapes of UTF-8 bytes; a literal % is %25)' });
    }
    const name = await uploadWith('%FF=1');
    expect(name.statusCode).toBe(400);
    expect(name.json().error).toEqual({ code: 'KF_VALIDATION', message: 'querystring: a parameter name holds a malformed percent-escape (expected %XX escapes of UTF-8 bytes; a literal % is %25)' });
    expect(await redis.keys(`${env['KEYFLEET_PREFIX']}:batch:*`)).toEqual([]);
    const results = await call(app, admin, 'GET', '/v1/batches/abcdefgh/results?from=1%');
    expect(results.statusCode).toBe(400);
    expect(results.json().error).toEqual({ code: 'KF_VALIDATION', message: expect.stringContaining('parameter "from" holds a malformed percent-escape') });
    // Well-formed escapes are read as before: %25 is a literal %.
    const escaped = await uploadWith('context=100%25%20%E2%82%AC');
    expect(escaped.statusCode).toBe(202);
    const job = await app.services.queue.getJob(chunkJobId(escaped.json().batchId, 0));
    expect(app.services.batches.openContext(escaped.json().batchId, job!.data.tenant, job!.data.sealedContext!)).toBe('100% €');
  });

  it('reads `from` as digits only, and refuses its other spellings', async () => {
    for (const from of ['1e3', '0x10', '', '-1', '1.5', ' 2', '9999999999999999']) {
      const res = await call(app, admin, 'GET', `/v1/batches/abcdefgh/results?from=${encodeURIComponent(from)}`);
      expect(res.statusCode, from).toBe(400);
      expect(res.json().error, from).toEqual({ code: 'KF_VALIDATION', message: 'querystring.from: expected a whole number of items' });
    }
    // Read, the batch is looked up: there is none.
    expect((await call(app, admin, 'GET', '/v1/batches/abcdefgh/results?from=12')).json().error.code).toBe('KF_BATCH_NOT_FOUND');
  });
});

describe('sync bodies of many items', () => {
  const { env, admin } = testEnv();
  let app: FastifyInstance;
  beforeAll(async () => {
    app = await api(env);
    expect((await call(app, admin, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
  });

  it('reads a body of a million items that are not strings at the cost of strings: no validation issue is built per item', async () => {
    // Validation runs on the event loop: through the old union a million such items took 2.8 s, and
    // a 16 MB body of them held every other request (healthz too) for over 20 s. The cost is counted, not
    // timed (timings flake on a loaded machine): zod builds every issue through the error map.
    let issues = 0;
    z.config({ customError: () => void issues++ });
    try {
      const kinds: unknown[] = [0, null, true, {}, [], { plaintext: 1 }, { plaintext: 'x', context: '' }, { ciphertext: 'x', extra: 1 }];
      const items = Array.from({ length: 1_000_000 }, (_, i) => kinds[i % kinds.length]);
      const answer = await call(app, admin, 'POST', '/v1/encrypt/serials', JSON.stringify({ items, mode: 'sync' }), { 'content-type': 'application/json' });
      expect(answer.statusCode).toBe(400);
      expect(answer.json().error.code).toBe('KF_SYNC_LIMIT');
      expect(issues).toBe(0);
      // The same kinds in a request of a few items still fail alone, each in its place.
      const few = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['a', ...kinds, 'b'], mode: 'sync' });
      expect(few.json().results.map((r: { error?: { code: string } }) => r.error?.code ?? 'ok')).toEqual(['ok', ...kinds.map(() => 'KF_INVALID_ITEM'), 'ok']);
    } finally {
      z.config({ customError: undefined });
    }
  });
});

describe('backpressure and rate limits', () => {
  const { env, admin, other } = testEnv({ MAX_BACKLOG_ITEMS: '1000', SYNC_RATE_LIMIT: '5' });
  let app: FastifyInstance;
  let replica: FastifyInstance;
  beforeAll(async () => {
    app = await api(env);
    replica = await api(env);
    for (const who of [admin, other]) expect((await call(app, who, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
  });

  it('answers new batches 429 with Retry-After once the queued backlog passes MAX_BACKLOG_ITEMS', async () => {
    // No worker runs here: 1,200 items stay queued.
    const first = await upload(app, admin, 'encrypt', Array.from({ length: 1200 }, (_, i) => `S-${i}`));
    expect(first.statusCode).toBe(202);
    const refused = await upload(app, other, 'encrypt', ['one more']);
    expect(refused.statusCode).toBe(429);
    expect(refused.json().error.code).toBe('KF_BACKLOG_FULL');
    expect(Number(refused.headers['retry-after'])).toBeGreaterThan(0);
    // Cancelling gives the items back: batches are accepted again.
    await call(app, admin, 'DELETE', `/v1/batches/${first.json().batchId}`);
    expect((await upload(app, other, 'encrypt', ['now fine'])).statusCode).toBe(202);
  });

  /** Waits for the next second of the wall clock to begin: the limiter's windows are those seconds. */
  const nextWindow = (): Promise<void> => sleep(1_000 - (Date.now() % 1_000) + 5);

  it('limits a tenant’s sync requests per second on every API replica, without touching other tenants', async () => {
    let answers: Awaited<ReturnType<typeof call>>[] = [];
    // All 20 must fall in one 1 s window; a stalled machine gets another try.
    for (let attempt = 1; attempt <= 3; attempt++) {
      await nextWindow();
      const window = Math.floor(Date.now() / 1_000);
      answers = await Promise.all(
        Array.from({ length: 20 }, (_, i) => call(i % 2 ? replica : app, admin, 'POST', '/v1/encrypt/serials', { items: ['x'] })),
      );
      if (Math.floor(Date.now() / 1_000) === window) break;
    }
    const statuses = answers.map((a) => a.statusCode);
    // 20 at once against a limit of 5: each replica admits at most its 5 before it hears the
    // other's count (a round trip at the window's start). Counts shared between replicas: below.
    expect(statuses.filter((s) => s === 200).length).toBeLessThanOrEqual(10);
    const limited = answers.filter((a) => a.statusCode === 429);
    expect(limited.length).toBeGreaterThanOrEqual(10);
    expect(limited[0]!.json().error.code).toBe('KF_RATE_LIMITED');
    expect(Number(limited[0]!.headers['retry-after'])).toBeGreaterThan(0);
    expect(new Set(answers.flatMap((a, i) => (a.statusCode === 429 ? [i % 2] : []))).size).toBe(2);
    expect((await call(app, other, 'POST', '/v1/encrypt/serials', { items: ['x'] })).statusCode).toBe(200);
  });

  it('refuses a tenant over its budget before reading the body', async () => {
    const address = await replica.listen({ host: '127.0.0.1', port: 0 });
    const { port } = new URL(address);
    // The headers of a 1 MB body, and no body: a limiter that waited for it would answer
    // nothing until UPLOAD_IDLE_SECONDS, then 408. A lapsed window (a stalled machine) gets
    // another try.
    for (let attempt = 1; ; attempt++) {
      await nextWindow();
      for (let i = 0; i < 6; i++) await call(replica, admin, 'POST', '/v1/encrypt/serials', { items: ['x'] });
      const answer = await new Promise<string>((resolve, reject) => {
        const socket = connect(Number(port), '127.0.0.1');
        let text = '';
        const timer = setTimeout(() => socket.destroy(), 2_000);
        socket.on('data', (piece) => (text += piece.toString('latin1')));
        socket.on('close', () => (clearTimeout(timer), resolve(text)));
        socket.on('error', reject);
        socket.write(`POST /v1/encrypt/serials HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer ${admin.token}\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\nconnection: close\r\n\r\n{"items":[`);
      });
      if (!answer.startsWith('HTTP/1.1 429') && attempt < 3) continue;
      expect(answer).toMatch(/^HTTP\/1\.1 429 /);
      expect(answer).toContain('"KF_RATE_LIMITED"');
      break;
    }
  });

  it('counts one replica’s requests against another’s once they have exchanged counts, and the three sync routes as one budget', async () => {
    // Every request must fall in one 1 s window; a stalled machine gets another try.
    for (let attempt = 1; ; attempt++) {
      await nextWindow();
      const window = Math.floor(Date.now() / 1_000);
      // Until Redis holds the window's total, and the replica that sent it has read the answer.
      const counted = `${env['KEYFLEET_PREFIX']}:rate:${admin.tenant}sync:${window}`;
      const exchanged = async (total: number): Promise<void> => {
        for (let i = 0; i < 400 && Number(await redis.get(counted)) !== total; i++) await sleep(5);
        await sleep(EXCHANGE_MS);
      };
      for (let i = 0; i < 4; i++) expect((await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['x'] })).statusCode).toBe(200);
      await exchanged(4); // the 4 reach Redis
      // The other replica's first request in the window counts before it has heard them…
      const first = await call(replica, admin, 'POST', '/v1/decrypt/serials', { items: ['x'] });
      await exchanged(5); // …and its exchange for it hears 5
      const more = await Promise.all(['encrypt', 'rewrap'].map((op) => call(replica, admin, 'POST', `/v1/${op}/serials`, { items: ['x'] })));
      if (Math.floor(Date.now() / 1_000) !== window && attempt < 3) continue;
      expect(first.statusCode).toBe(200);
      // 4 through one replica + 1 through the other against a limit of 5: the next two are refused.
      expect(more.map((a) => a.statusCode)).toEqual([429, 429]);
      break;
    }
  });
});

describe('idempotency', () => {
  const { env, admin, other } = testEnv({ SYNC_MAX_ITEMS: '5' });
  let app: FastifyInstance;
  beforeAll(async () => {
    app = await api(env);
    for (const who of [admin, other]) expect((await call(app, who, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
  });

  it('answers a repeated sync call with the same Idempotency-Key and body with the first answer, without encrypting again', async () => {
    const key = { 'idempotency-key': 'order-1001' };
    const first = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['LIC-1', 'LIC-2'] }, key);
    const again = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['LIC-1', 'LIC-2'] }, key);
    expect(first.statusCode).toBe(200);
    // Random nonces: a second encryption could never give the same ciphertexts.
    expect(again.json()).toEqual(first.json());
    expect(again.headers['idempotent-replayed']).toBe('true');
    const fresh = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['LIC-1', 'LIC-2'] });
    expect(fresh.json()).not.toEqual(first.json());
  });

  it('answers the same key with another body 409, and keeps keys apart per tenant', async () => {
    const key = { 'idempotency-key': 'order-1002' };
    expect((await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['A'] }, key)).statusCode).toBe(200);
    const clash = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['B'] }, key);
    expect(clash.statusCode).toBe(409);
    expect(clash.json().error.code).toBe('KF_IDEMPOTENCY_MISMATCH');
    expect((await call(app, other, 'POST', '/v1/encrypt/serials', { items: ['B'] }, key)).statusCode).toBe(200);
  });

  it('keeps an upload’s claim on its key through the longest pause between pieces that UPLOAD_IDLE_SECONDS allows', async () => {
    const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
    const store = new IdempotencyStore(redis, keys, new AtRestSealer(randomBytes(32)), 60, pendingMs(300));
    await store.claim('acme', 'slow-upload', 'fp');
    const slot = keys.idempotency(createHash('sha256').update('acme\nslow-upload').digest('hex'));
    // Renewed only as pieces arrive: a pause of 300 s must not free the key for a second upload.
    expect(await redis.pttl(slot)).toBeGreaterThan(300_000);
    expect(pendingMs(60)).toBe(120_000);
    await store.release('acme', 'slow-upload');
  });

  it('answers a repeated key creation with the same Idempotency-Key with its first 201, so a retry after a lost answer still says created', async () => {
    const key = { 'idempotency-key': 'create-vault-1' };
    const first = await call(app, admin, 'POST', '/v1/keys/vault', { type: 'xchacha20-poly1305' }, key);
    const again = await call(app, admin, 'POST', '/v1/keys/vault', { type: 'xchacha20-poly1305' }, key);
    expect(first.statusCode).toBe(201);
    expect(again.statusCode).toBe(201);
    expect(again.headers['idempotent-replayed']).toBe('true');
    expect(again.json()).toEqual(first.json());
    // Without a key, or with another one, the key is found as before: 200.
    expect((await call(app, admin, 'POST', '/v1/keys/vault', { type: 'xchacha20-poly1305' })).statusCode).toBe(200);
    expect((await call(app, admin, 'POST', '/v1/keys/vault', { type: 'xchacha20-poly1305' }, { 'idempotency-key': 'create-vault-2' })).statusCode).toBe(200);
    const clash = await call(app, admin, 'POST', '/v1/keys/vault', { type: 'aes256-gcm96' }, key);
    expect(clash.statusCode).toBe(409);
    expect(clash.json().error.code).toBe('KF_IDEMPOTENCY_MISMATCH');
    // No body and an empty one ask for the same key.
    const plain = { 'idempotency-key': 'create-plain' };
    expect((await call(app, admin, 'POST', '/v1/keys/plain', undefined, plain)).statusCode).toBe(201);
    expect((await call(app, admin, 'POST', '/v1/keys/plain', {}, plain)).statusCode).toBe(201);
  });

  it('refuses a malformed Idempotency-Key with 400', async () => {
    const res = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['A'] }, { 'idempotency-key': 'x'.repeat(300) });
    expect(res.statusCode).toBe(400);
    expect(res.json().error.code).toBe('KF_IDEMPOTENCY_KEY_INVALID');
  });

  it('returns the same batch for a repeated upload with the same key, and 409 for another upload with it', async () => {
    const items = Array.from({ length: 50 }, (_, i) => `SER-${i}`);
    const key = { 'idempotency-key': 'import-2026-11-23' };
    const first = await upload(app, admin, 'encrypt', items, key);
    const again = await upload(app, admin, 'encrypt', items, key);
    expect(first.statusCode).toBe(202);
    expect(again.statusCode).toBe(202);
    expect(again.json()).toEqual(first.json());
    const batches = await redis.smembers(`${env['KEYFLEET_PREFIX']}:tenant:acme:batches`);
    expect(batches).toEqual([first.json().batchId]);
    const clash = await upload(app, admin, 'encrypt', [...items, 'one more'], key);
    expect(clash.statusCode).toBe(409);
    expect(clash.json().error.code).toBe('KF_IDEMPOTENCY_MISMATCH');
    // A sync request that went async is idempotent the same way.
    const asyncKey = { 'idempotency-key': 'big-sync-call' };
    const viaSync = await call(app, admin, 'POST', '/v1/encrypt/serials', { items }, asyncKey);
    expect(viaSync.statusCode).toBe(202);
    expect((await call(app, admin, 'POST', '/v1/encrypt/serials', { items }, asyncKey)).json()).toEqual(viaSync.json());
  });

  it('answers with the work done when its answer cannot be stored; a retry meanwhile is a 409, not a second batch', async () => {
    const tenantBatches = `${env['KEYFLEET_PREFIX']}:tenant:acme:batches`;
    const before = new Set(await redis.smembers(tenantBatches));
    const items = Array.from({ length: 20 }, (_, i) => `LOST-${i}`);
    const { idempotency } = app.services;
    // Redis stops answering between the work and the storing of its answer (an own property
    // shadows the store's method for this test only).
    idempotency.complete = async () => {
      throw new Error('Command timed out');
    };
    let first;
    let sync;
    try {
      first = await upload(app, admin, 'encrypt', items, { 'idempotency-key': 'answer-lost' });
      sync = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['A', 'B'] }, { 'idempotency-key': 'sync-answer-lost' });
    } finally {
      delete (idempotency as Partial<typeof idempotency>).complete;
    }
    expect(first.statusCode).toBe(202);
    expect(sync.statusCode).toBe(200);
    expect(sync.json().results).toHaveLength(2);
    const retry = await upload(app, admin, 'encrypt', items, { 'idempotency-key': 'answer-lost' });
    expect(retry.statusCode).toBe(409);
    expect(retry.json().error.code).toBe('KF_IDEMPOTENCY_IN_PROGRESS');
    const syncRetry = await call(app, admin, 'POST', '/v1/encrypt/serials', { items: ['A', 'B'] }, { 'idempotency-key': 'sync-answer-lost' });
    expect(syncRetry.statusCode).toBe(409);
    expect(syncRetry.json().error.code).toBe('KF_IDEMPOTENCY_IN_PROGRESS');
    expect((await redis.smembers(tenantBatches)).filter((id) => !before.has(id))).toEqual([first.json().batchId]);
  });

  it('frees the key of a request that failed, so that its retry runs', async () => {
    const key = { 'idempotency-key': 'retry-me' };
    const missing = await call(app, admin, 'POST', '/v1/encrypt/nokey', { items: ['A'] }, key);
    expect(missing.statusCode).toBe(404);
    expect((await call(app, admin, 'POST', '/v1/keys/nokey')).statusCode).toBe(201);
    expect((await call(app, admin, 'POST', '/v1/encrypt/nokey', { items: ['A'] }, key)).statusCode).toBe(200);
  });
});

describe('plaintext at rest', () => {
  const { env, admin } = testEnv({ CHUNK_ITEMS: '100' });
  let app: FastifyInstance;
  let worker: RunningProcess | undefined;
  const secrets = Array.from({ length: 300 }, (_, i) => `PLAINTEXT-SECRET-${i}-${'q'.repeat(i % 7)}`);
  beforeAll(async () => {
    app = await api(env);
    expect((await call(app, admin, 'POST', '/v1/keys/serials')).statusCode).toBe(201);
  });
  afterAll(async () => {
    await worker?.stop();
  });

  it('stores neither the inputs of encrypt batches nor the results of decrypt batches (nor idempotent answers) in clear, and DELETE removes them', async () => {
    const prefix = env['KEYFLEET_PREFIX']!;
    const queued = await upload(app, admin, 'encrypt', secrets);
    expect(queued.statusCode).toBe(202);
    // Queued, with no worker yet: the chunk inputs and job payloads are in Redis now.
    let dump = await dumpPrefix(prefix);
    expect(dump.length).toBeGreaterThan(0);
    for (const s of secrets) expect(dump.includes(s)).toBe(false);

    worker = await startWorker(env);
    const encId = queued.json().batchId;
    await waitFor(app, admin, encId);
    const sealed = (await call(app, admin, 'GET', `/v1/batches/${encId}/results`)).body.trim().split('\n').map((l) => JSON.parse(l).ciphertext);
    const dec = await upload(app, admin, 'decrypt', sealed);
    await waitFor(app, admin, dec.json().batchId);
    const opened = (await call(app, admin, 'GET', `/v1/batches/${dec.json().batchId}/results`)).body.trim().split('\n').map((l) => JSON.parse(l).plaintext);
    expect(opened).toEqual(secrets);
    const replayed = await call(app, admin, 'POST', '/v1/decrypt/serials', { items: sealed.slice(0, 3) }, { 'idempotency-key': 'peek' });
    expect(replayed.json().results.map((r: any) => r.plaintext)).toEqual(secrets.slice(0, 3));

    dump = await dumpPrefix(prefix);
    for (const s of secrets) expect(dump.includes(s)).toBe(false);

    // Everything of a batch expires, and DELETE removes its inputs and results at once.
    const batchKeys = await redis.keys(`${prefix}:batch:${dec.json().batchId}*`);
    for (const k of batchKeys) expect(await redis.ttl(k)).toBeGreaterThan(0);
    expect((await call(app, admin, 'DELETE', `/v1/batches/${dec.json().batchId}`)).statusCode).toBe(200);
    expect(await redis.keys(`${prefix}:batch:${dec.json().batchId}:*`)).toEqual([]);
    expect((await call(app, admin, 'GET', `/v1/batches/${dec.json().batchId}/results`)).statusCode).toBe(410);
  });
});

async function waitFor(app: FastifyInstance, who: TestTenant, id: string): Promise<void> {
  for (let i = 0; i < 600; i++) {
    const status = (await call(app, who, 'GET', `/v1/batches/${id}`)).json().status;
    if (status === 'completed') return;
    if (status !== 'queued' && status !== 'running') throw new Error(`batch ${id} ended ${status}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`batch ${id} did not complete`);
}
