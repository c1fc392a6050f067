import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { Writable } from 'node:stream';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createLogger } from '../../shared/logger.js';
import { buildApp } from '../../producer/app.js';
import { bearer, configFrom, testEnv } from '../helpers/env.js';

const { env, admin, encryptOnly, other } = testEnv();
let app: FastifyInstance;
const logLines: string[] = [];

beforeAll(async () => {
  const sink = new Writable({ write: (chunk, _enc, done) => (logLines.push(String(chunk)), done()) });
  app = await buildApp({ config: configFrom({ ...env, LOG_LEVEL: 'info', LOG_REQUESTS: 'true' }), logger: createLogger({ level: 'info', name: 'test-api', destination: sink }) });
  await app.ready();
});
afterAll(async () => {
  await app?.close();
});

const post = (url: string, body: unknown, who = admin) => app.inject({ method: 'POST', url, headers: bearer(who), payload: body as object });
const encrypt = async (key: string, items: string[], extra: object = {}) => (await post(`/v1/encrypt/${key}`, { items, ...extra })).json().results;
const decrypt = async (key: string, items: string[], extra: object = {}) => (await post(`/v1/decrypt/${key}`, { items, ...extra })).json().results;

describe('keys', () => {
  it('creates a key (201), finds it again (200), refuses another type (409) and never returns material', async () => {
    const created = await app.inject({ method: 'POST', url: '/v1/keys/licences', headers: bearer(admin) });
    expect(created.statusCode).toBe(201);
    expect(created.json()).toMatchObject({ name: 'licences', type: 'aes256-gcm96', latestVersion: 1, minDecryptionVersion: 1 });
    expect(Object.keys(created.json()).sort()).toEqual(['autoRotatePeriod', 'convergent', 'createdAt', 'deletionAllowed', 'latestVersion', 'minDecryptionVersion', 'minEncryptionVersion', 'name', 'type']);
    const again = await post('/v1/keys/licences', { type: 'aes256-gcm96' });
    expect(again.statusCode).toBe(200);
    const otherType = await post('/v1/keys/licences', { type: 'rsa-4096' });
    expect(otherType.statusCode).toBe(400);
    expect(otherType.json().error.code).toBe('KF_VALIDATION');
  });

  it('stores key material only wrapped: no raw 32-byte value in Redis', async () => {
    const redis = new Redis(env['REDIS_URL']!);
    const fields = await redis.hgetall(`${env['KEYFLEET_PREFIX']}:key:acme:licences`);
    await redis.quit();
    expect(fields['m:1']).toMatch(/^w1:[0-9a-f]{8}:/);
    expect(Buffer.from(fields['m:1']!.split(':')[2]!, 'base64').length).toBe(12 + 32 + 16);
  });

  it('answers 404 for a key that does not exist and for another tenant’s key alike', async () => {
    const missing = await app.inject({ method: 'GET', url: '/v1/keys/nope', headers: bearer(admin) });
    const foreign = await app.inject({ method: 'GET', url: '/v1/keys/licences', headers: bearer(other) });
    expect(missing.statusCode).toBe(404);
    expect(foreign.statusCode).toBe(404);
    // Each names the key asked for, and nothing else: another tenant's key reads as no key at all.
    const notFound = (name: string) => ({ error: { code: 'KF_KEY_NOT_FOUND', message: `no key named "${name}"` } });
    expect(missing.json()).toEqual(notFound('nope'));
    expect(foreign.json()).toEqual(notFound('licences'));
  });
});

describe('sync encrypt and decrypt', () => {
  it('encrypts five items to kf:v1 ciphertexts and decrypts them back in order', async () => {
    const items = ['LIC-0001', 'LIC-0002', 'ünïcødé ✓', '', 'x'.repeat(500)];
    const sealed = await encrypt('licences', items);
    expect(sealed).toHaveLength(5);
    for (const r of sealed) expect(r.ciphertext).toMatch(/^kf:v1:[A-Za-z0-9+/]+=*$/);
    const opened = await decrypt('licences', sealed.map((r: any) => r.ciphertext));
    expect(opened.map((r: any) => r.plaintext)).toEqual(items);
  });

  it('round-trips binary plaintexts with encoding base64', async () => {
    const bytes = Buffer.from([0, 255, 128, 10, 13]).toString('base64');
    const [sealed] = await encrypt('licences', [bytes], { encoding: 'base64' });
    const [asText] = await decrypt('licences', [sealed.ciphertext]);
    expect(asText.error.code).toBe('KF_NOT_UTF8');
    const [asBytes] = await decrypt('licences', [sealed.ciphertext], { encoding: 'base64' });
    expect(asBytes.plaintext).toBe(bytes);
  });

  it('fails only the bad items: tampered, unknown version, garbage and wrong key', async () => {
    await post('/v1/keys/other-key', {});
    const [good, foreignKey] = [(await encrypt('licences', ['good']))[0].ciphertext, (await encrypt('other-key', ['x']))[0].ciphertext];
    const raw = Buffer.from(good.slice(6), 'base64');
    raw[raw.length - 1]! ^= 1;
    const tampered = `kf:v1:${raw.toString('base64')}`;
    const results = await decrypt('licences', [good, tampered, good.replace('kf:v1:', 'kf:v7:'), 'not a ciphertext', foreignKey, good]);
    expect(results[0]).toEqual({ plaintext: 'good' });
    expect(results[5]).toEqual({ plaintext: 'good' });
    for (const r of results.slice(1, 5)) expect(r).toEqual({ error: { code: 'KF_DECRYPT_FAILED', message: 'decryption failed' } });
  });

  it('fails an item that is not a string or an item object alone, as a bad line of an upload fails', async () => {
    const invalid = { error: { code: 'KF_INVALID_ITEM', message: 'the item is not a JSON string of well-formed UTF-8 text (nor, in a synchronous request, a valid item object)' } };
    const items = ['first', 42, null, { plaintext: 5 }, { plaintext: 'x', extra: 1 }, { plaintext: 'y', context: '' }, ['nested'], 'last', { plaintext: 'own' }];
    const sealed = (await post('/v1/encrypt/licences', { items })).json().results;
    expect(sealed.slice(1, 7)).toEqual(Array(6).fill(invalid));
    const good = [sealed[0], sealed[7], sealed[8]].map((r: any) => r.ciphertext);
    const opened = (await post('/v1/decrypt/licences', { items: [good[0], true, good[1], { ciphertext: good[2] }] })).json().results;
    expect(opened).toEqual([{ plaintext: 'first' }, invalid, { plaintext: 'last' }, { plaintext: 'own' }]);
    // With contexts the items go through the node:crypto path, which fails them the same way.
    const withContext = (await post('/v1/encrypt/licences', { items: [{ plaintext: 'a', context: 'c1' }, 7, 'b'], context: 'c0' })).json().results;
    expect(withContext[1]).toEqual(invalid);
    const back = (await post('/v1/decrypt/licences', { items: [{ ciphertext: withContext[0].ciphertext, context: 'c1' }, {}, withContext[2].ciphertext], context: 'c0' })).json().results;
    expect(back).toEqual([{ plaintext: 'a' }, invalid, { plaintext: 'b' }]);
    // An item object names what it holds: the wrong one for the route fails alone, not taken for the other.
    expect((await post('/v1/encrypt/licences', { items: ['ok', { ciphertext: 'not a plaintext' }] })).json().results[1]).toEqual(invalid);
    for (const op of ['decrypt', 'rewrap']) {
      const wrong = (await post(`/v1/${op}/licences`, { items: [{ plaintext: good[0] }, good[1]] })).json().results;
      expect(wrong[0], op).toEqual(invalid);
      expect(wrong[1], op).not.toHaveProperty('error');
    }
  });

  it('fails an item whose text has a lone surrogate alone on every route, and refuses a body that is not UTF-8 whole', async () => {
    const invalid = { error: { code: 'KF_INVALID_ITEM', message: 'the item is not a JSON string of well-formed UTF-8 text (nor, in a synchronous request, a valid item object)' } };
    // JSON escapes that make no character: encoded, each became U+FFFD, other text than was sent.
    const lone = ['\ud800', 'a\udc00b', '😀\ud83d', { plaintext: '\udfff' }, { plaintext: 'x', context: 'c\ud800' }];
    const sealed = (await post('/v1/encrypt/licences', { items: ['first', ...lone, '😀'] })).json().results;
    expect(sealed.slice(1, 6)).toEqual(Array(5).fill(invalid));
    const withContext = (await post('/v1/encrypt/licences', { items: ['first', ...lone, '😀'], context: 'c' })).json().results;
    expect(withContext.slice(1, 6)).toEqual(Array(5).fill(invalid));
    // Ciphertexts are ASCII: these failed before too, as KF_DECRYPT_FAILED; now as every route fails them.
    const [first, last] = [sealed[0].ciphertext, sealed[6].ciphertext];
    for (const op of ['decrypt', 'rewrap']) {
      const results = (await post(`/v1/${op}/licences`, { items: [first, `${first}\ud800`, { ciphertext: last, context: '\udc00' }, last] })).json().results;
      expect(results.slice(1, 3), op).toEqual([invalid, invalid]);
      expect(results.filter((r: object) => !('error' in r)), op).toHaveLength(2);
    }
    expect((await decrypt('licences', [first, last])).map((r: any) => r.plaintext)).toEqual(['first', '😀']);
    const badContext = await post('/v1/encrypt/licences', { items: ['a'], context: '\ud800' });
    expect(badContext.statusCode).toBe(400);
    expect(badContext.json().error).toEqual({ code: 'KF_VALIDATION', message: 'body.context: expected well-formed text (no lone surrogate)' });
    // A byte that is not UTF-8 cannot be told to belong to an item before the body is parsed.
    const notUtf8 = Buffer.concat([Buffer.from('{"items":["first","A'), Buffer.from([0xff]), Buffer.from('"]}')]);
    const refused = await app.inject({ method: 'POST', url: '/v1/encrypt/licences', headers: { ...bearer(admin), 'content-type': 'application/json' }, payload: notUtf8 });
    expect(refused.statusCode).toBe(400);
    expect(refused.json().error).toEqual({ code: 'KF_INVALID_JSON', message: 'the body is not valid UTF-8, as JSON text must be' });
  });

  it('rotates, rewraps old ciphertexts to the new version, and enforces minDecryptionVersion per item', async () => {
    await post('/v1/keys/rotating', {});
    const v1 = (await encrypt('rotating', ['alpha', 'beta'])).map((r: any) => r.ciphertext);
    const rotated = await post('/v1/keys/rotating/rotate', undefined);
    expect(rotated.json().latestVersion).toBe(2);
    const [fresh] = await encrypt('rotating', ['gamma']);
    expect(fresh.ciphertext).toMatch(/^kf:v2:/);
    const rewrapped = (await (await post('/v1/rewrap/rotating', { items: v1 })).json()).results;
    for (const r of rewrapped) expect(r.ciphertext).toMatch(/^kf:v2:/);

    const patched = await app.inject({ method: 'PATCH', url: '/v1/keys/rotating', headers: bearer(admin), payload: { minDecryptionVersion: 2 } });
    expect(patched.json().minDecryptionVersion).toBe(2);
    const results = await decrypt('rotating', [v1[0], rewrapped[0].ciphertext, fresh.ciphertext]);
    expect(results[0].error.code).toBe('KF_KEY_VERSION_DISABLED');
    expect(results.slice(1)).toEqual([{ plaintext: 'alpha' }, { plaintext: 'gamma' }]);
    const tooHigh = await app.inject({ method: 'PATCH', url: '/v1/keys/rotating', headers: bearer(admin), payload: { minDecryptionVersion: 3 } });
    expect(tooHigh.statusCode).toBe(400);
    expect(tooHigh.json().error.code).toBe('KF_KEY_VERSION_INVALID');
  });
});

describe('auth and input errors', () => {
  it('answers 401 without a token or with a wrong one, 403 without the scope', async () => {
    const none = await app.inject({ method: 'POST', url: '/v1/encrypt/licences', payload: { items: ['a'] } });
    expect(none.statusCode).toBe(401);
    expect(none.json().error.code).toBe('KF_UNAUTHORIZED');
    const wrong = await app.inject({ method: 'POST', url: '/v1/encrypt/licences', headers: { authorization: `Bearer ${admin.token}x` }, payload: { items: ['a'] } });
    expect(wrong.statusCode).toBe(401);
    expect((await post('/v1/encrypt/licences', { items: ['a'] }, encryptOnly)).statusCode).toBe(200);
    const denied = await post('/v1/decrypt/licences', { items: ['a'] }, encryptOnly);
    expect(denied.statusCode).toBe(403);
    expect(denied.json().error.code).toBe('KF_FORBIDDEN');
  });

  it('authenticates a token of the longest length KEYFLEET_TOKENS accepts (512 characters)', async () => {
    const longest = { tenant: 'acme', token: `tok_${randomBytes(254).toString('hex')}` };
    expect(longest.token).toHaveLength(512);
    const longApp = await buildApp({ config: configFrom({ ...env, KEYFLEET_TOKENS: `${env['KEYFLEET_TOKENS']},${longest.tenant}:${longest.token}:keys` }) });
    try {
      const res = await longApp.inject({ method: 'POST', url: '/v1/keys/longest-token', headers: bearer(longest) });
      expect(res.statusCode, res.body).toBe(201);
      expect((await longApp.inject({ method: 'GET', url: '/v1/keys/longest-token', headers: { authorization: `Bearer ${longest.token}x` } })).statusCode).toBe(401);
    } finally {
      await longApp.close();
    }
  });

  it('authenticates a token of any visible ASCII character KEYFLEET_TOKENS accepts, through Bearer and Basic alike', async () => {
    // All of ! to ~ but : and , (they separate fields and entries), spaced out with random text.
    const visible = Array.from({ length: 0x7e - 0x21 + 1 }, (_, i) => String.fromCharCode(0x21 + i)).filter((c) => c !== ':' && c !== ',').join('');
    const symbols = { tenant: 'acme', token: `${visible}${randomBytes(8).toString('hex')}` };
    const symbolsApp = await buildApp({ config: configFrom({ ...env, KEYFLEET_TOKENS: `${env['KEYFLEET_TOKENS']},${symbols.tenant}:${symbols.token}:keys` }) });
    try {
      expect((await symbolsApp.inject({ method: 'POST', url: '/v1/keys/visible-token', headers: bearer(symbols) })).statusCode).toBe(201);
      const basic = { authorization: `Basic ${Buffer.from(`acme:${symbols.token}`).toString('base64')}` };
      expect((await symbolsApp.inject({ method: 'GET', url: '/v1/keys/visible-token', headers: basic })).statusCode).toBe(200);
    } finally {
      await symbolsApp.close();
    }
  });

  it('answers bad bodies with a 4xx and a stable code', async () => {
    const cases: Array<[unknown, string, number]> = [
      [{ items: 'a' }, 'KF_VALIDATION', 400],
      [{ items: ['a'], encoding: 'rot13' }, 'KF_VALIDATION', 400],
      [{ items: ['a'], extra: true }, 'KF_VALIDATION', 400],
    ];
    for (const [body, code, status] of cases) {
      const res = await post('/v1/encrypt/licences', body);
      expect(res.statusCode, JSON.stringify(body)).toBe(status);
      expect(res.json().error.code).toBe(code);
    }
    const badJson = await app.inject({ method: 'POST', url: '/v1/encrypt/licences', headers: { ...bearer(admin), 'content-type': 'application/json' }, payload: '{"items": [' });
    expect(badJson.statusCode).toBe(400);
    expect(badJson.json().error.code).toBe('KF_INVALID_JSON');
    const unknownKey = await post('/v1/encrypt/nope', { items: ['a'] });
    expect(unknownKey.statusCode).toBe(404);
    expect(unknownKey.json().error).toEqual({ code: 'KF_KEY_NOT_FOUND', message: 'no key named "nope"' });
    // A rewrap names the one of its two keys that is missing.
    const unknownTarget = await post('/v1/rewrap/licences', { items: ['a'], targetKey: 'nowhere' });
    expect(unknownTarget.statusCode).toBe(404);
    expect(unknownTarget.json().error).toEqual({ code: 'KF_KEY_NOT_FOUND', message: 'no key named "nowhere"' });
    const badName = await post('/v1/encrypt/bad%20name', { items: ['a'] });
    expect(badName.statusCode).toBe(400);
  });

  it('takes an empty body sent as application/json as no body: a rotate or a DELETE goes through, a route that needs a body says so', async () => {
    const empty = (method: 'POST' | 'PATCH' | 'DELETE', url: string) => app.inject({ method, url, headers: { ...bearer(admin), 'content-type': 'application/json' }, payload: '' });
    expect((await empty('POST', '/v1/keys/headered')).statusCode).toBe(201);
    expect((await empty('POST', '/v1/keys/headered/rotate')).json().latestVersion).toBe(2);
    const noItems = await empty('POST', '/v1/encrypt/headered');
    expect(noItems.statusCode).toBe(400);
    expect(noItems.json().error).toMatchObject({ code: 'KF_VALIDATION', message: expect.stringMatching(/^body: /) });
    expect((await empty('PATCH', '/v1/keys/headered')).json().error.code).toBe('KF_VALIDATION');
    await app.inject({ method: 'PATCH', url: '/v1/keys/headered', headers: bearer(admin), payload: { deletionAllowed: true } });
    expect((await empty('DELETE', '/v1/keys/headered')).statusCode).toBe(204);
    // Whitespace is not nothing: it is JSON text that holds no value.
    const blank = await app.inject({ method: 'POST', url: '/v1/keys/headered/rotate', headers: { ...bearer(admin), 'content-type': 'application/json' }, payload: ' ' });
    expect(blank.json().error.code).toBe('KF_INVALID_JSON');
  });

  it('refuses a compressed body with 415 before reading it, and only a body', async () => {
    const send = (url: string, headers: Record<string, string>, payload: string) => app.inject({ method: 'POST', url, headers: { ...bearer(admin), ...headers }, payload });
    const json = JSON.stringify({ items: ['x'] });
    const message = (coding: string) => ({ code: 'KF_UNSUPPORTED_MEDIA_TYPE', message: `content-encoding ${coding} is not accepted: send the body uncompressed` });
    for (const coding of ['gzip', 'identity, br', 'DEFLATE']) {
      const res = await send('/v1/encrypt/licences', { 'content-type': 'application/json', 'content-encoding': coding }, json);
      expect(res.statusCode, coding).toBe(415);
      expect(res.json().error, coding).toEqual(message(coding));
    }
    const upload = await send('/v1/batches?op=encrypt&key=licences', { 'content-type': 'application/x-ndjson', 'content-encoding': 'br' }, '"x"\n');
    expect(upload.json().error).toEqual(message('br'));
    // No body, nothing to misread; the token is checked first.
    expect((await app.inject({ method: 'GET', url: '/v1/keys/licences', headers: { ...bearer(admin), 'content-encoding': 'gzip' } })).statusCode).toBe(200);
    expect((await app.inject({ method: 'POST', url: '/v1/encrypt/licences', headers: { 'content-type': 'application/json', 'content-encoding': 'gzip' }, payload: json })).statusCode).toBe(401);
    for (const coding of ['identity', 'Identity, identity', '']) {
      expect((await send('/v1/encrypt/licences', { 'content-type': 'application/json', 'content-encoding': coding }, json)).statusCode, coding).toBe(200);
    }
    // A charset label is not what counts, the bytes are: an ASCII body labelled latin1 is read.
    expect((await send('/v1/encrypt/licences', { 'content-type': 'application/json; charset=ISO-8859-1' }, json)).statusCode).toBe(200);
  });

  it('keeps secrets out of the logs', async () => {
    await encrypt('licences', ['TOP-SECRET-SERIAL-42']);
    const logs = logLines.join('');
    expect(logs).toContain('"url":"/v1/encrypt/licences"');
    expect(logs).not.toContain('TOP-SECRET-SERIAL-42');
    expect(logs).not.toContain(admin.token);
    expect(logs).not.toContain(env['KEYFLEET_MASTER_KEY']);
  });

  it('logs each request only with LOG_REQUESTS; without it, lines a request does write still carry its reqId', async () => {
    const lines: string[] = [];
    const sink = new Writable({ write: (chunk, _enc, done) => (lines.push(String(chunk)), done()) });
    const quiet = await buildApp({ config: configFrom({ ...env, LOG_LEVEL: 'info', SYNC_MAX_ITEMS: '2' }), logger: createLogger({ level: 'info', name: 'quiet-api', destination: sink }) });
    try {
      const sync = await quiet.inject({ method: 'POST', url: '/v1/encrypt/licences', headers: bearer(admin), payload: { items: ['a'] } });
      expect(sync.statusCode).toBe(200);
      expect(lines.join('')).not.toContain('/v1/encrypt/licences');
      // Three items are more than SYNC_MAX_ITEMS: the request becomes a batch and says so.
      const batch = await quiet.inject({ method: 'POST', url: '/v1/encrypt/licences', headers: { ...bearer(admin), 'x-request-id': 'trace-me-1' }, payload: { items: ['a', 'b', 'c'] } });
      expect(batch.statusCode).toBe(202);
      const said = lines.map((l) => JSON.parse(l)).find((l) => l.msg === 'request became a batch');
      expect(said).toMatchObject({ reqId: 'trace-me-1', batchId: batch.json().batchId });
    } finally {
      await quiet.close();
    }
    // The app of this file runs with LOG_REQUESTS=true: both of fastify's lines, with the id.
    const before = logLines.length;
    const logged = await app.inject({ method: 'GET', url: '/healthz', headers: { 'x-request-id': 'trace-me-2' } });
    expect(logged.statusCode).toBe(200);
    const mine = logLines.slice(before).map((l) => JSON.parse(l)).filter((l) => l.reqId === 'trace-me-2');
    expect(mine.map((l) => l.msg)).toEqual(['incoming request', 'request completed']);
    // A request line shows the path and which parameters were sent, but not what a callbackUrl
    // (credentials) or a context (whose items) says.
    const query = 'op=encrypt&key=licences&context=acct-4242&callbackUrl=https%3A%2F%2Fhooks.example.com%2Fh%3Ftoken%3Dhook-secret-77';
    await app.inject({ method: 'POST', url: `/v1/batches?${query}`, headers: { ...bearer(admin), 'content-type': 'application/x-ndjson', 'x-request-id': 'trace-me-3' }, payload: '"a"\n' });
    const line = logLines.map((l) => JSON.parse(l)).find((l) => l.reqId === 'trace-me-3' && l.msg === 'incoming request');
    expect(line.req).toMatchObject({ method: 'POST', url: '/v1/batches?op=encrypt&key=licences&context=[redacted]&callbackUrl=[redacted]' });
    expect(logLines.join('')).not.toMatch(/hook-secret-77|acct-4242/);
  });

  it('interoperates across kernels: what an API on the node:crypto kernel seals, this one opens, and back', async () => {
    const js = await buildApp({ config: configFrom({ ...env, KEYFLEET_KERNEL: 'js' }) });
    try {
      const items = ['alpha', 'ünïcødé', ''];
      const viaJs = (await js.inject({ method: 'POST', url: '/v1/encrypt/licences', headers: bearer(admin), payload: { items } })).json().results;
      expect(await decrypt('licences', viaJs.map((r: any) => r.ciphertext))).toEqual(items.map((plaintext) => ({ plaintext })));
      const viaNative = await encrypt('licences', items);
      const back = (await js.inject({ method: 'POST', url: '/v1/decrypt/licences', headers: bearer(admin), payload: { items: viaNative.map((r: any) => r.ciphertext) } })).json().results;
      expect(back).toEqual(items.map((plaintext) => ({ plaintext })));
    } finally {
      await js.close();
    }
  });

  it('says so clearly when it runs with another master key than the key was made under', async () => {
    const other = await buildApp({ config: configFrom({ ...env, KEYFLEET_MASTER_KEY: Buffer.alloc(32, 7).toString('base64') }) });
    try {
      const res = await other.inject({ method: 'POST', url: '/v1/encrypt/licences', headers: bearer(admin), payload: { items: ['x'] } });
      expect(res.statusCode).toBe(500);
      expect(res.json().error.code).toBe('KF_MASTER_KEY_MISMATCH');
    } finally {
      await other.close();
    }
  });

  it('serves healthz and readyz without a token', async () => {
    expect((await app.inject({ method: 'GET', url: '/healthz' })).json()).toEqual({ status: 'ok' });
    expect((await app.inject({ method: 'GET', url: '/readyz' })).json()).toEqual({ status: 'ready' });
  });
});

describe('metrics', () => {
  const sample = (text: string, name: string, labels: string): number => {
    const line = text.split('\n').find((l) => l.startsWith(`${name}{`) && labels.split(',').every((label) => l.includes(label)));
    return line ? Number(line.slice(line.lastIndexOf(' ') + 1)) : 0;
  };
  const scrape = async () => (await app.inject({ method: 'GET', url: '/metrics' })).body;

  it('times each request under its route template and status, and counts each routing decision', async () => {
    const route = 'route="/v1/encrypt/:key"';
    const before = await scrape();
    for (let i = 0; i < 3; i++) expect((await post('/v1/encrypt/licences', { items: ['a', 'b'] })).statusCode).toBe(200);
    expect((await post('/v1/encrypt/licences', { items: 'not a list' })).statusCode).toBe(400);
    expect((await post('/v1/encrypt/licences', { items: ['a'], mode: 'async' })).statusCode).toBe(202);
    const after = await scrape();
    const delta = (name: string, labels: string) => sample(after, name, labels) - sample(before, name, labels);
    expect(delta('keyfleet_http_request_duration_seconds_count', `method="POST",${route},status_code="200"`)).toBe(3);
    expect(delta('keyfleet_http_request_duration_seconds_count', `method="POST",${route},status_code="400"`)).toBe(1);
    expect(delta('keyfleet_http_request_duration_seconds_count', `method="POST",${route},status_code="202"`)).toBe(1);
    expect(delta('keyfleet_sync_routing_total', 'decision="sync"')).toBe(3);
    expect(delta('keyfleet_sync_routing_total', 'decision="async"')).toBe(1);
    expect(after).not.toContain('licences'); // key names are never labels
  });
});
