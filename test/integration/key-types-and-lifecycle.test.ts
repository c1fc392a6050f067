import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import { execFileSync } from 'node:child_process';
import { createCipheriv, randomBytes } from 'node:crypto';
import { resolve } from 'node:path';
import { Writable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KeyCache } from '../../shared/key-cache.js';
import { KeyChanges } from '../../shared/key-changes.js';
import { KeyStore } from '../../shared/key-store.js';
import { MasterKey } from '../../shared/master-key.js';
import { chunkJobId } from '../../shared/queue.js';
import { chunkJobData, context as contextSchema } from '../../shared/schemas.js';
import { ConnectionErrorLog, RedisKeys } from '../../shared/redis.js';
import { createLogger } from '../../shared/logger.js';
import { call, TestApis } from '../helpers/apps.js';
import { bearer, testEnv, type TestTenant } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';

const apis = new TestApis();
const api = (env: Record<string, string>) => apis.start(env);
const workers: RunningProcess[] = [];
const redis = new Redis(testEnv().env['REDIS_URL']!);
afterAll(async () => {
  await Promise.all(workers.map((w) => w.stop()));
  await apis.close();
  await redis.quit();
});
const results = async (app: FastifyInstance, who: TestTenant, op: string, key: string, body: object) => {
  const res = await call(app, who, 'POST', `/v1/${op}/${key}`, body);
  expect(res.statusCode, res.body).toBe(200);
  return res.json().results as Array<{ ciphertext?: string; plaintext?: string; error?: { code: string } }>;
};
const waitFor = async (app: FastifyInstance, who: TestTenant, id: string) => {
  for (let i = 0; i < 600; i++) {
    const status = (await call(app, who, 'GET', `/v1/batches/${id}`)).json();
    if (status.status !== 'queued' && status.status !== 'running') return status;
    await sleep(50);
  }
  throw new Error(`batch ${id} did not end`);
};
const batchResults = async (app: FastifyInstance, who: TestTenant, id: string) =>
  (await call(app, who, 'GET', `/v1/batches/${id}/results`)).body.trim().split('\n').map((l) => JSON.parse(l));

describe('key types, context and convergent keys', () => {
  const { env, admin } = testEnv({ SYNC_MAX_ITEMS: '50', CHUNK_ITEMS: '40' });
  let app: FastifyInstance;
  beforeAll(async () => {
    app = await api(env);
    workers.push(await startWorker(env));
  });

  it('xchacha20-poly1305 keys encrypt and decrypt on the sync path and in batches (libsodium in the worker threads)', async () => {
    const created = await call(app, admin, 'POST', '/v1/keys/tokens', { type: 'xchacha20-poly1305' });
    expect(created.json()).toMatchObject({ type: 'xchacha20-poly1305', convergent: false });
    const sealed = await results(app, admin, 'encrypt', 'tokens', { items: ['tok-1', 'tok-2'] });
    // 24-byte nonce + 5-byte plaintext + 16-byte tag.
    expect(Buffer.from(sealed[0]!.ciphertext!.slice(6), 'base64').length).toBe(24 + 5 + 16);
    const items = Array.from({ length: 120 }, (_, i) => `token-${i}`);
    const batch = (await call(app, admin, 'POST', '/v1/encrypt/tokens', { items })).json();
    expect((await waitFor(app, admin, batch.batchId)).succeeded).toBe(120);
    const cts = (await batchResults(app, admin, batch.batchId)).map((l) => l.ciphertext);
    expect((await results(app, admin, 'decrypt', 'tokens', { items: [sealed[0]!.ciphertext!, ...cts.slice(0, 10)] })).map((r) => r.plaintext)).toEqual(['tok-1', ...items.slice(0, 10)]);
  });

  it('binds a context: the request’s or each item’s; decrypt needs the same one, a wrong one fails that item alone', async () => {
    await call(app, admin, 'POST', '/v1/keys/pii');
    const sealed = await results(app, admin, 'encrypt', 'pii', { context: 'customers', items: ['alice', { plaintext: 'bob', context: 'suppliers' }] });
    const [alice, bob] = sealed.map((r) => r.ciphertext!);
    const opened = await results(app, admin, 'decrypt', 'pii', { items: [{ ciphertext: alice!, context: 'customers' }, { ciphertext: bob!, context: 'suppliers' }, { ciphertext: alice!, context: 'suppliers' }, alice!] });
    expect(opened.map((r) => r.plaintext ?? r.error!.code)).toEqual(['alice', 'bob', 'KF_DECRYPT_FAILED', 'KF_DECRYPT_FAILED']);
    // A batch takes one context for all its items.
    const upload = await app.inject({ method: 'POST', url: '/v1/batches?op=decrypt&key=pii&context=customers', headers: { ...bearer(admin), 'content-type': 'application/x-ndjson' }, payload: `${JSON.stringify(alice)}\n${JSON.stringify(bob)}\n` });
    expect(upload.statusCode).toBe(202);
    await waitFor(app, admin, upload.json().batchId);
    expect((await batchResults(app, admin, upload.json().batchId)).map((l) => l.plaintext ?? l.error.code)).toEqual(['alice', 'KF_DECRYPT_FAILED']);
    // The chunk's job (what Bull Board shows, what a Redis dump holds) carries the context sealed, as the logs redact it.
    const job = await redis.hget(`${env['KEYFLEET_PREFIX']}:chunks:${chunkJobId(upload.json().batchId, 0)}`, 'data');
    expect(JSON.parse(job!)).toMatchObject({ batchId: upload.json().batchId, sealedContext: expect.any(String) });
    expect(job).not.toContain('customers');
  });

  it('convergent keys give the same ciphertext for the same plaintext and context, and refuse to work without a context', async () => {
    expect((await call(app, admin, 'POST', '/v1/keys/serial-index', { convergent: true })).json()).toMatchObject({ convergent: true });
    const one = await results(app, admin, 'encrypt', 'serial-index', { context: 'serials', items: ['SN-1', 'SN-1', 'SN-2'] });
    expect(one[0]!.ciphertext).toBe(one[1]!.ciphertext);
    expect(one[0]!.ciphertext).not.toBe(one[2]!.ciphertext);
    const again = await results(app, admin, 'encrypt', 'serial-index', { context: 'serials', items: ['SN-1'] });
    expect(again[0]!.ciphertext).toBe(one[0]!.ciphertext);
    const none = await call(app, admin, 'POST', '/v1/encrypt/serial-index', { items: ['SN-1'] });
    expect(none.statusCode).toBe(400);
    expect(none.json().error.code).toBe('KF_CONTEXT_REQUIRED');
    // An unreadable item needs no context: it fails alone, and the others are sealed.
    const mixed = await results(app, admin, 'encrypt', 'serial-index', { items: [{ plaintext: 'SN-1', context: 'serials' }, 5] });
    expect(mixed[0]!.ciphertext).toBe(one[0]!.ciphertext);
    expect(mixed[1]!.error!.code).toBe('KF_INVALID_ITEM');
    const noBatchContext = await app.inject({ method: 'POST', url: '/v1/batches?op=encrypt&key=serial-index', headers: { ...bearer(admin), 'content-type': 'application/x-ndjson' }, payload: '"SN-1"\n' });
    expect(noBatchContext.json().error.code).toBe('KF_CONTEXT_REQUIRED');
    // Decrypt and rewrap need it too, on the sync path and for batches: refused up front, not
    // item by item; with it, decrypt gives the plaintexts back.
    const sealed = one.map((r) => r.ciphertext!);
    for (const [op, body] of [['decrypt', { items: sealed }], ['rewrap', { items: sealed }], ['rewrap', { items: sealed, targetKey: 'serials-plain' }]] as const) {
      if (op === 'rewrap' && 'targetKey' in body) expect((await call(app, admin, 'POST', '/v1/keys/serials-plain')).statusCode).toBeLessThan(300);
      const refused = await call(app, admin, 'POST', `/v1/${op}/serial-index`, body);
      expect(refused.statusCode, `${op} ${JSON.stringify(Object.keys(body))}`).toBe(400);
      expect(refused.json().error.code).toBe('KF_CONTEXT_REQUIRED');
    }
    for (const query of ['op=decrypt&key=serial-index', 'op=rewrap&key=serial-index&targetKey=serials-plain']) {
      const batch = await app.inject({ method: 'POST', url: `/v1/batches?${query}`, headers: { ...bearer(admin), 'content-type': 'application/x-ndjson' }, payload: `${JSON.stringify(sealed[0])}\n` });
      expect(batch.statusCode, query).toBe(400);
      expect(batch.json().error.code).toBe('KF_CONTEXT_REQUIRED');
    }
    const opened = await results(app, admin, 'decrypt', 'serial-index', { context: 'serials', items: sealed });
    expect(opened.map((r) => r.plaintext)).toEqual(['SN-1', 'SN-1', 'SN-2']);
    // Changing the key's convergence under the same name is refused.
    expect((await call(app, admin, 'POST', '/v1/keys/serial-index', { convergent: false })).statusCode).toBe(409);
  });
});

describe('a batch context in its chunk jobs', () => {
  const { env, admin } = testEnv();
  const jobKey = (batchId: string) => `${env['KEYFLEET_PREFIX']}:chunks:${chunkJobId(batchId, 0)}`;

  it('runs a job queued with the context in clear (an older API), fails one whose sealed context does not open, and is refused by an older worker', async () => {
    const app = await api(env);
    await call(app, admin, 'POST', '/v1/keys/ctx');
    const sealed = await results(app, admin, 'encrypt', 'ctx', { context: 'customers', items: ['alice', 'bob'] });
    const upload = () => app.inject({ method: 'POST', url: '/v1/batches?op=decrypt&key=ctx&context=customers', headers: { ...bearer(admin), 'content-type': 'application/x-ndjson' }, payload: sealed.map((r) => JSON.stringify(r.ciphertext)).join('\n') + '\n' });
    // Queued with no worker running: what a new API puts in a job, then changed as the cases need.
    const [older, tampered] = [(await upload()).json().batchId as string, (await upload()).json().batchId as string];
    const data = JSON.parse((await redis.hget(jobKey(older), 'data'))!);
    expect(data).toMatchObject({ sealedContext: expect.any(String), context: '' });
    // An earlier worker's schema (context: 1 character at least; unknown fields dropped) refuses it.
    expect(chunkJobData.omit({ sealedContext: true }).extend({ context: contextSchema.optional() }).safeParse(data).success).toBe(false);
    const { sealedContext: _, ...clear } = data;
    await redis.hset(jobKey(older), 'data', JSON.stringify({ ...clear, context: 'customers' }));
    // The record as an earlier API wrote it, too: it says nothing of a context (with `ctx` it
    // holds its jobs to a sealed one; chunk-accounting.test.ts).
    await redis.hdel(new RedisKeys(env['KEYFLEET_PREFIX']!).batch(older), 'ctx');
    const other = JSON.parse((await redis.hget(jobKey(tampered), 'data'))!);
    await redis.hset(jobKey(tampered), 'data', JSON.stringify({ ...other, sealedContext: Buffer.alloc(40, 7).toString('base64') }));

    workers.push(await startWorker(env));
    expect(await waitFor(app, admin, older)).toMatchObject({ status: 'completed', succeeded: 2 });
    expect((await batchResults(app, admin, older)).map((l) => l.plaintext)).toEqual(['alice', 'bob']);
    expect(await waitFor(app, admin, tampered)).toMatchObject({ status: 'failed', error: { code: 'KF_CHUNK_FAILED', message: expect.stringContaining('the batch context could not be opened') } });
  });
});

describe('legacy CBC keys and the rewrap scope', () => {
  it('rewrapping out of a legacy key needs the decrypt scope too: a rewrap-only token would read plaintexts through a padding oracle', async () => {
    const made = testEnv();
    const rewrapOnly = { tenant: made.admin.tenant, token: `tok_${randomBytes(16).toString('hex')}` };
    const app = await api({ ...made.env, KEYFLEET_TOKENS: `${made.env['KEYFLEET_TOKENS']},${rewrapOnly.tenant}:${rewrapOnly.token}:rewrap+keys+batches` });
    const { admin } = made;
    const material = randomBytes(32);
    expect((await call(app, admin, 'POST', '/v1/keys/old/import', { type: 'legacy-aes256-cbc', material: material.toString('base64') })).statusCode).toBe(201);
    expect((await call(app, admin, 'POST', '/v1/keys/new')).statusCode).toBe(201);
    const iv = randomBytes(16);
    const cipher = createCipheriv('aes-256-cbc', material, iv);
    const legacy = `${iv.toString('hex')}:${Buffer.concat([cipher.update('PIN-0042'), cipher.final()]).toString('hex')}`;

    const sync = await call(app, rewrapOnly, 'POST', '/v1/rewrap/old', { items: [legacy], targetKey: 'new' });
    expect(sync.statusCode).toBe(403);
    expect(sync.json().error).toMatchObject({ code: 'KF_FORBIDDEN', message: expect.stringMatching(/decrypt scope/) });
    const batch = await call(app, rewrapOnly, 'POST', '/v1/batches?op=rewrap&key=old&targetKey=new', `"${legacy}"\n`, { 'content-type': 'application/x-ndjson' });
    expect(batch.statusCode).toBe(403);
    expect(batch.json().error.code).toBe('KF_FORBIDDEN');

    // A token with decrypt rewraps out of it; a rewrap-only token still rewraps authenticated keys.
    const moved = await results(app, admin, 'rewrap', 'old', { items: [legacy], targetKey: 'new' });
    expect(await results(app, admin, 'decrypt', 'new', { items: [moved[0]!.ciphertext!] })).toEqual([{ plaintext: 'PIN-0042' }]);
    expect((await results(app, rewrapOnly, 'rewrap', 'new', { items: [moved[0]!.ciphertext!] }))[0]!.ciphertext).toMatch(/^kf:v1:/);
  });
});

describe('convergent keys and the rewrap scope', () => {
  it('rewrapping into a convergent key needs the decrypt scope too: rewrapped items would show which plaintexts are equal', async () => {
    const made = testEnv();
    const rewrapOnly = { tenant: made.admin.tenant, token: `tok_${randomBytes(16).toString('hex')}` };
    const app = await api({ ...made.env, KEYFLEET_TOKENS: `${made.env['KEYFLEET_TOKENS']},${rewrapOnly.tenant}:${rewrapOnly.token}:rewrap+encrypt+keys+batches` });
    const { admin } = made;
    expect((await call(app, admin, 'POST', '/v1/keys/random')).statusCode).toBe(201);
    expect((await call(app, admin, 'POST', '/v1/keys/pins', { convergent: true })).statusCode).toBe(201);
    // Two items of the same plaintext, under a key with random nonces: unalike ciphertexts.
    const sealed = (await results(app, admin, 'encrypt', 'random', { context: 'user-42', items: ['4821', '4821'] })).map((r) => r.ciphertext!);
    expect(sealed[0]).not.toBe(sealed[1]);

    const sync = await call(app, rewrapOnly, 'POST', '/v1/rewrap/random', { items: sealed, context: 'user-42', targetKey: 'pins' });
    expect(sync.statusCode).toBe(403);
    expect(sync.json().error).toMatchObject({ code: 'KF_FORBIDDEN', message: expect.stringMatching(/convergent key needs the decrypt scope/) });
    expect(sync.body).not.toContain('kf:v1:');
    const async = await call(app, rewrapOnly, 'POST', '/v1/rewrap/random', { items: sealed, context: 'user-42', targetKey: 'pins', mode: 'async' });
    expect([async.statusCode, async.json().error.code]).toEqual([403, 'KF_FORBIDDEN']);
    const batch = await call(app, rewrapOnly, 'POST', '/v1/batches?op=rewrap&key=random&targetKey=pins&context=user-42', sealed.map((c) => `"${c}"`).join('\n'), { 'content-type': 'application/x-ndjson' });
    expect([batch.statusCode, batch.json().error.code]).toEqual([403, 'KF_FORBIDDEN']);
    // The same key's own rewrap (to its latest version) seals under it too.
    const pins = (await results(app, admin, 'encrypt', 'pins', { context: 'user-42', items: ['4821'] })).map((r) => r.ciphertext!);
    expect((await call(app, rewrapOnly, 'POST', '/v1/rewrap/pins', { items: pins, context: 'user-42' })).statusCode).toBe(403);

    // With decrypt the rewrap goes through, and equal plaintexts do come out equal; a
    // rewrap-only token still rewraps between keys of random nonces.
    const moved = await results(app, admin, 'rewrap', 'random', { items: sealed, context: 'user-42', targetKey: 'pins' });
    expect(moved[0]!.ciphertext).toBe(moved[1]!.ciphertext);
    expect((await call(app, admin, 'POST', '/v1/keys/random-2')).statusCode).toBe(201);
    expect((await results(app, rewrapOnly, 'rewrap', 'random', { items: sealed, context: 'user-42', targetKey: 'random-2' })).map((r) => r.ciphertext)).toEqual([expect.stringMatching(/^kf:v1:/), expect.stringMatching(/^kf:v1:/)]);
  });
});

describe('nonce budget and automatic rotation', () => {
  it('counts encryptions per version in Redis and rotates by itself at NONCE_ROTATE_SHARE of NONCE_LIMIT', async () => {
    const { env, admin } = testEnv({ NONCE_LIMIT: '20', NONCE_ROTATE_SHARE: '0.5' });
    const lines: string[] = [];
    const sink = new Writable({ write: (chunk, _enc, done) => (lines.push(String(chunk)), done()) });
    const app = await apis.start(env, createLogger({ level: 'info', name: 'keyfleet-api', destination: sink }));
    await call(app, admin, 'POST', '/v1/keys/budget');
    await results(app, admin, 'encrypt', 'budget', { items: Array(10).fill('x') });
    const hash = `${env['KEYFLEET_PREFIX']}:key:acme:budget`;
    for (let i = 0; i < 100 && (await redis.hget(hash, 'n:1')) !== '10'; i++) await sleep(20);
    expect(await redis.hget(hash, 'n:1')).toBe('10');
    for (let i = 0; i < 100 && (await call(app, admin, 'GET', '/v1/keys/budget')).json().latestVersion === 1; i++) await sleep(20);
    const next = await results(app, admin, 'encrypt', 'budget', { items: ['y'] });
    expect(next[0]!.ciphertext).toMatch(/^kf:v2:/);
    const metrics = (await app.inject({ method: 'GET', url: '/metrics' })).body;
    expect(metrics).toMatch(/keyfleet_key_auto_rotations_total\{reason="nonce_budget",component="api"\} 1/);
    expect(metrics).toMatch(/keyfleet_nonce_budget_max_used_ratio\{component="api"\} 0\.5/);
    // Which key: with several rotating, a version number alone tells them apart from nothing.
    const rotated = lines.map((line) => JSON.parse(line) as Record<string, unknown>).filter((line) => line['msg'] === 'key rotated automatically');
    expect(rotated).toEqual([expect.objectContaining({ tenant: 'acme', key: 'budget', reason: 'nonce_budget', version: 2 })]);
  });

  it('writes every count the sync path gathered, at the latest when the API closes', async () => {
    const { env, admin } = testEnv();
    const app = await apis.start(env);
    await call(app, admin, 'POST', '/v1/keys/gathered');
    await Promise.all(Array.from({ length: 20 }, () => results(app, admin, 'encrypt', 'gathered', { items: ['a', 'b', 'c'] })));
    await call(app, admin, 'POST', '/v1/encrypt/gathered', { items: ['d'] });
    // The last count is at most 50 ms old: closing writes it rather than dropping it.
    await app.close();
    const hash = `${env['KEYFLEET_PREFIX']}:key:acme:gathered`;
    expect(await redis.hget(hash, 'n:1')).toBe('61');
  });

  it('keeps a count Redis refused and writes it later, so the budget misses no encryption', async () => {
    const { env, admin } = testEnv();
    const app = await apis.start(env);
    await call(app, admin, 'POST', '/v1/keys/refused');
    const { store } = app.services.keyCache;
    const refusedAt: number[] = [];
    // Redis refuses the first three writes of a count (an own property shadows the method for this test only).
    store.countEncryptions = async (...args) => {
      if (refusedAt.length < 3) {
        refusedAt.push(performance.now());
        throw new Error('OOM command not allowed when used memory > maxmemory');
      }
      return KeyStore.prototype.countEncryptions.apply(store, args);
    };
    try {
      await results(app, admin, 'encrypt', 'refused', { items: ['a', 'b', 'c'] });
      await results(app, admin, 'encrypt', 'refused', { items: ['d'] });
      const hash = `${env['KEYFLEET_PREFIX']}:key:acme:refused`;
      for (let i = 0; i < 250 && (await redis.hget(hash, 'n:1')) !== '4'; i++) await sleep(20);
      expect(refusedAt).toHaveLength(3);
      expect(await redis.hget(hash, 'n:1')).toBe('4');
      // Tried again later each time: 100 ms after the first refusal, at least 200 ms after the second.
      expect(refusedAt[2]! - refusedAt[1]!).toBeGreaterThanOrEqual(190);
    } finally {
      delete (store as Partial<typeof store>).countEncryptions;
    }
  });

  it('keeps a count whose write fails before it starts (a synchronous throw) for the next flush', async () => {
    const { env, admin } = testEnv();
    const app = await apis.start(env);
    await call(app, admin, 'POST', '/v1/keys/thrown');
    const { store } = app.services.keyCache;
    let thrown = 0;
    store.countEncryptions = (...args) => {
      if (thrown++ === 0) throw new Error('thrown before the write started');
      return KeyStore.prototype.countEncryptions.apply(store, args);
    };
    try {
      await results(app, admin, 'encrypt', 'thrown', { items: ['a', 'b'] });
      const hash = `${env['KEYFLEET_PREFIX']}:key:acme:thrown`;
      for (let i = 0; i < 100 && (await redis.hget(hash, 'n:1')) !== '2'; i++) await sleep(20);
      expect([thrown, await redis.hget(hash, 'n:1')]).toEqual([2, '2']);
    } finally {
      delete (store as Partial<typeof store>).countEncryptions;
    }
  });

  it('refuses to encrypt past NONCE_LIMIT under one version (409) when rotation is left to the operator, and still decrypts', async () => {
    const { env, admin } = testEnv({ NONCE_LIMIT: '5', NONCE_ROTATE_SHARE: '0' });
    const app = await api(env);
    await call(app, admin, 'POST', '/v1/keys/capped');
    const sealed = await results(app, admin, 'encrypt', 'capped', { items: Array(5).fill('x') });
    const hash = `${env['KEYFLEET_PREFIX']}:key:acme:capped`;
    for (let i = 0; i < 100 && (await redis.hget(hash, 'n:1')) !== '5'; i++) await sleep(20);
    const refused = await call(app, admin, 'POST', '/v1/encrypt/capped', { items: ['one more'] });
    expect(refused.statusCode).toBe(409);
    expect(refused.json().error.code).toBe('KF_NONCE_BUDGET_EXHAUSTED');
    expect((await results(app, admin, 'decrypt', 'capped', { items: [sealed[0]!.ciphertext!] }))[0]!.plaintext).toBe('x');
    // A rotation gives the key a fresh budget; pinning the spent version does not get round it.
    await call(app, admin, 'POST', '/v1/keys/capped/rotate');
    expect((await results(app, admin, 'encrypt', 'capped', { items: ['one more'] }))[0]!.ciphertext).toMatch(/^kf:v2:/);
    const pinned = await call(app, admin, 'POST', '/v1/encrypt/capped', { items: ['one more'], keyVersion: 1 });
    expect(pinned.statusCode).toBe(409);
    expect(pinned.json().error.code).toBe('KF_NONCE_BUDGET_EXHAUSTED');
    expect(await redis.hget(hash, 'n:1')).toBe('5');
  });

  it('refuses a request or a chunk whose items would take the version past NONCE_LIMIT, whole and before sealing any', async () => {
    const { env, admin } = testEnv({ NONCE_LIMIT: '10', NONCE_ROTATE_SHARE: '0', CHUNK_ITEMS: '100' });
    const app = await api(env);
    const prefix = env['KEYFLEET_PREFIX']!;
    await call(app, admin, 'POST', '/v1/keys/edge');
    await results(app, admin, 'encrypt', 'edge', { items: Array(8).fill('x') });
    const over = await call(app, admin, 'POST', '/v1/encrypt/edge', { items: Array(3).fill('y') });
    expect(over.statusCode).toBe(409);
    expect(over.json().error.code).toBe('KF_NONCE_BUDGET_EXHAUSTED');
    expect(await results(app, admin, 'encrypt', 'edge', { items: ['a', 'b'] })).toHaveLength(2); // exactly up to the limit
    for (let i = 0; i < 100 && (await redis.hget(`${prefix}:key:acme:edge`, 'n:1')) !== '10'; i++) await sleep(20);
    expect(await redis.hget(`${prefix}:key:acme:edge`, 'n:1')).toBe('10');

    // In a batch, a chunk of 11 items under a fresh key with a budget of 10.
    await call(app, admin, 'POST', '/v1/keys/edge-batch');
    const upload = await app.inject({ method: 'POST', url: '/v1/batches?op=encrypt&key=edge-batch', headers: { ...bearer(admin), 'content-type': 'application/x-ndjson' }, payload: Array(11).fill('"z"').join('\n') + '\n' });
    expect(upload.statusCode).toBe(202);
    // Started once the upload is whole: a chunk refused while it still arrived would fail the upload.
    workers.push(await startWorker(env));
    const ended = await waitFor(app, admin, upload.json().batchId);
    expect(ended).toMatchObject({ status: 'failed', error: { code: 'KF_CHUNK_FAILED', message: expect.stringContaining('KF_NONCE_BUDGET_EXHAUSTED') } });
    // Its one chunk never ran: each item's line says so, in order, and none is a ciphertext.
    const notProcessed = { code: 'KF_ITEM_NOT_PROCESSED', message: 'the batch failed before this item was processed (its status says why)' };
    expect(await batchResults(app, admin, ended.id)).toEqual(Array.from({ length: 11 }, (_, i) => ({ i, error: notProcessed })));
    expect(await redis.hget(`${prefix}:key:acme:edge-batch`, 'n:1')).toBeNull();
  });

  it('gives the results of a failed batch\'s chunks that ran, and KF_ITEM_NOT_PROCESSED for the items of the others', async () => {
    // One thread, one chunk at a time, in order: chunks of 3, 3, 3 and 2 items under a budget of
    // 7, so the first two run, the third is refused whole and fails the batch, and the last, after
    // it, finds the batch ended.
    const { env, admin } = testEnv({ NONCE_LIMIT: '7', NONCE_ROTATE_SHARE: '0', CHUNK_ITEMS: '3', WORKER_THREADS: '1', WORKER_CONCURRENCY: '1' });
    const app = await api(env);
    await call(app, admin, 'POST', '/v1/keys/partial');
    const items = Array.from({ length: 11 }, (_, i) => `serial-${i}`);
    const upload = await app.inject({ method: 'POST', url: '/v1/batches?op=encrypt&key=partial', headers: { ...bearer(admin), 'content-type': 'application/x-ndjson' }, payload: items.map((item) => JSON.stringify(item)).join('\n') + '\n' });
    expect(upload.statusCode).toBe(202);
    // Started once the upload is whole (as above).
    workers.push(await startWorker(env));
    const ended = await waitFor(app, admin, upload.json().batchId);
    expect(ended).toMatchObject({ status: 'failed', total: 11, processed: 6, succeeded: 6, failed: 0, error: { code: 'KF_CHUNK_FAILED', message: expect.stringContaining('KF_NONCE_BUDGET_EXHAUSTED') } });

    const lines = await batchResults(app, admin, ended.id);
    expect(lines.map((line) => line.i)).toEqual(items.map((_, i) => i));
    expect(lines.slice(6)).toEqual([6, 7, 8, 9, 10].map((i) => ({ i, error: { code: 'KF_ITEM_NOT_PROCESSED', message: 'the batch failed before this item was processed (its status says why)' } })));
    const ciphertexts = lines.slice(0, 6).map((line) => line.ciphertext as string);
    expect(ciphertexts.every((c) => c.startsWith('kf:v1:'))).toBe(true);
    expect((await results(app, admin, 'decrypt', 'partial', { items: ciphertexts })).map((r) => r.plaintext)).toEqual(items.slice(0, 6));

    // `from` inside a chunk that never ran, and inside one that did.
    const from7 = (await call(app, admin, 'GET', `/v1/batches/${ended.id}/results?from=7`)).body.trim().split('\n').map((l) => JSON.parse(l));
    expect(from7.map((line) => [line.i, line.error?.code])).toEqual([7, 8, 9, 10].map((i) => [i, 'KF_ITEM_NOT_PROCESSED']));
    const from4 = (await call(app, admin, 'GET', `/v1/batches/${ended.id}/results?from=4`)).body.trim().split('\n').map((l) => JSON.parse(l));
    expect(from4.map((line) => line.i)).toEqual([4, 5, 6, 7, 8, 9, 10]);
    expect(from4.slice(0, 2).map((line) => line.ciphertext)).toEqual(ciphertexts.slice(4));

    // Which chunks ran is lost (the bitmap evicted, or deleted under the download): the results
    // are gone, not the items unprocessed.
    await redis.del(`${env['KEYFLEET_PREFIX']}:batch:${ended.id}:done`);
    const gone = await call(app, admin, 'GET', `/v1/batches/${ended.id}/results?from=9`);
    expect([gone.statusCode, gone.json().error.code]).toEqual([410, 'KF_BATCH_DELETED']);
  });

  it('numbers a failed batch\'s lines right when CHUNK_BYTES closed its chunks at uneven counts', async () => {
    // Chunks close at 64 KiB: 2 items of 40 KB, 5 of 15 KB, 3 of 30 KB, 1 of 64 KiB, then 4 short
    // ones. A budget of 7 runs the first two; the third is refused whole and fails the batch.
    const { env, admin } = testEnv({ NONCE_LIMIT: '7', NONCE_ROTATE_SHARE: '0', CHUNK_ITEMS: '1000', CHUNK_BYTES: String(64 * 1024), WORKER_THREADS: '1', WORKER_CONCURRENCY: '1' });
    const app = await api(env);
    await call(app, admin, 'POST', '/v1/keys/uneven');
    const sized = (count: number, bytes: number, tag: string) => Array.from({ length: count }, (_, i) => `${tag}${i}-`.padEnd(bytes, 'x'));
    const items = [...sized(2, 40_000, 'a'), ...sized(5, 15_000, 'b'), ...sized(3, 30_000, 'c'), ...sized(1, 64 * 1024, 'd'), ...sized(4, 10, 'e')];
    const upload = await app.inject({ method: 'POST', url: '/v1/batches?op=encrypt&key=uneven', headers: { ...bearer(admin), 'content-type': 'application/x-ndjson' }, payload: items.map((item) => JSON.stringify(item)).join('\n') + '\n' });
    expect(upload.statusCode, upload.body).toBe(202);
    const id: string = upload.json().batchId;
    const starts = (await redis.getBuffer(`${env['KEYFLEET_PREFIX']}:batch:${id}:starts`))!;
    expect(Array.from({ length: starts.length / 4 }, (_, c) => starts.readUInt32BE(c * 4))).toEqual([0, 2, 7, 10, 11]);
    workers.push(await startWorker(env));
    const ended = await waitFor(app, admin, id);
    expect(ended).toMatchObject({ status: 'failed', total: 15, processed: 7, succeeded: 7, error: { code: 'KF_CHUNK_FAILED', message: expect.stringContaining('KF_NONCE_BUDGET_EXHAUSTED') } });

    const notProcessed = (i: number) => ({ i, error: { code: 'KF_ITEM_NOT_PROCESSED', message: 'the batch failed before this item was processed (its status says why)' } });
    const lines = await batchResults(app, admin, id);
    expect(lines.map((line) => line.i)).toEqual(items.map((_, i) => i));
    expect(lines.slice(7)).toEqual(items.slice(7).map((_, i) => notProcessed(7 + i)));
    const opened = await results(app, admin, 'decrypt', 'uneven', { items: lines.slice(0, 7).map((line) => line.ciphertext as string) });
    expect(opened.map((r) => r.plaintext)).toEqual(items.slice(0, 7));
    // From inside the chunk of five that ran, inside the refused one, and on the large item's chunk.
    for (const from of [4, 8, 10]) {
      const rest = (await call(app, admin, 'GET', `/v1/batches/${id}/results?from=${from}`)).body.trim().split('\n').map((l) => JSON.parse(l));
      expect(rest).toEqual(lines.slice(from));
    }
  });

  it('a rewrap that meets a version rotated in by another API seals under that version and counts against it', async () => {
    const { env, admin } = testEnv();
    const [a, b] = [await api(env), await api(env)];
    const hash = `${env['KEYFLEET_PREFIX']}:key:acme:moving`;
    await call(a, admin, 'POST', '/v1/keys/moving');
    await results(a, admin, 'encrypt', 'moving', { items: ['x'] }); // API a now holds version 1
    await call(b, admin, 'POST', '/v1/keys/moving/rotate');
    const v2 = (await results(b, admin, 'encrypt', 'moving', { items: ['y'] }))[0]!.ciphertext!;
    for (let i = 0; i < 100 && (await redis.hget(hash, 'n:2')) !== '1'; i++) await sleep(20);
    expect(await redis.hget(hash, 'n:1')).toBe('1');

    expect((await results(a, admin, 'rewrap', 'moving', { items: [v2] }))[0]!.ciphertext).toMatch(/^kf:v2:/);
    for (let i = 0; i < 100 && (await redis.hget(hash, 'n:2')) !== '2'; i++) await sleep(20);
    expect([await redis.hget(hash, 'n:1'), await redis.hget(hash, 'n:2')]).toEqual(['1', '2']);
  });

  it('a key deleted and made again starts with a fresh budget, and a count of the old one does not bring it back', async () => {
    const { env, admin } = testEnv({ NONCE_LIMIT: '5', NONCE_ROTATE_SHARE: '0' });
    const app = await api(env);
    const hash = `${env['KEYFLEET_PREFIX']}:key:acme:reborn`;
    const made = async () => {
      await call(app, admin, 'POST', '/v1/keys/reborn');
      await call(app, admin, 'PATCH', '/v1/keys/reborn', { deletionAllowed: true });
    };
    await made();
    await results(app, admin, 'encrypt', 'reborn', { items: Array(5).fill('x') });
    for (let i = 0; i < 100 && (await redis.hget(hash, 'n:1')) !== '5'; i++) await sleep(20);
    expect((await call(app, admin, 'POST', '/v1/encrypt/reborn', { items: ['y'] })).json().error.code).toBe('KF_NONCE_BUDGET_EXHAUSTED');
    expect((await call(app, admin, 'DELETE', '/v1/keys/reborn')).statusCode).toBe(204);
    await made();
    // The same name and version, new material: its budget is its own, in this process too.
    expect((await results(app, admin, 'encrypt', 'reborn', { items: Array(5).fill('z') })).every((r) => r.ciphertext?.startsWith('kf:v1:'))).toBe(true);

    // A count that arrives after the delete (the API's wait up to 50 ms, so whether one is still
    // pending here is a matter of timing: the store is called directly too) is dropped, not
    // written into a hash of its own that a key made later under the name would take over.
    const { incarnation } = await app.services.keyCache.get('acme', 'reborn');
    expect((await call(app, admin, 'DELETE', '/v1/keys/reborn')).statusCode).toBe(204);
    await app.services.keyPolicy.flush();
    expect(await app.services.keyCache.store.countEncryptions('acme', 'reborn', incarnation, 1, 5)).toBe(-1);
    expect(await redis.exists(hash)).toBe(0);
  });

  it('rotates a key whose autoRotatePeriod has passed before its next encryption', async () => {
    const { env, admin } = testEnv();
    const app = await api(env);
    await call(app, admin, 'POST', '/v1/keys/periodic');
    expect((await call(app, admin, 'PATCH', '/v1/keys/periodic', { autoRotatePeriod: 1 })).json().autoRotatePeriod).toBe(1);
    await sleep(1_100);
    expect((await results(app, admin, 'encrypt', 'periodic', { items: ['x'] }))[0]!.ciphertext).toMatch(/^kf:v2:/);
  });
});

describe('key lifecycle', () => {
  const { env, admin } = testEnv();
  let app: FastifyInstance;
  beforeAll(async () => {
    app = await api(env);
  });

  it('trims versions below minDecryptionVersion for good, and deletes only a key marked deletionAllowed', async () => {
    await call(app, admin, 'POST', '/v1/keys/old');
    const v1 = (await results(app, admin, 'encrypt', 'old', { items: ['one'] }))[0]!.ciphertext!;
    await call(app, admin, 'POST', '/v1/keys/old/rotate');
    const v2 = (await results(app, admin, 'encrypt', 'old', { items: ['two'] }))[0]!.ciphertext!;
    const early = await call(app, admin, 'POST', '/v1/keys/old/trim', { minAvailableVersion: 2 });
    expect(early.statusCode).toBe(400);
    expect(early.json().error.code).toBe('KF_KEY_VERSION_INVALID');
    await call(app, admin, 'PATCH', '/v1/keys/old', { minDecryptionVersion: 2 });
    expect((await call(app, admin, 'POST', '/v1/keys/old/trim', { minAvailableVersion: 2 })).statusCode).toBe(200);
    expect(await redis.hexists(`${env['KEYFLEET_PREFIX']}:key:acme:old`, 'm:1')).toBe(0);
    // Nothing brings v1 back: its material is gone, and minDecryptionVersion cannot come back down over it.
    expect((await call(app, admin, 'PATCH', '/v1/keys/old', { minDecryptionVersion: 1 })).statusCode).toBe(400);
    expect((await results(app, admin, 'decrypt', 'old', { items: [v1, v2] })).map((r) => r.plaintext ?? r.error!.code)).toEqual(['KF_KEY_VERSION_DISABLED', 'two']);

    const refused = await call(app, admin, 'DELETE', '/v1/keys/old');
    expect(refused.statusCode).toBe(409);
    expect(refused.json().error.code).toBe('KF_KEY_DELETION_NOT_ALLOWED');
    expect((await call(app, admin, 'PATCH', '/v1/keys/old', { deletionAllowed: true })).json().deletionAllowed).toBe(true);
    expect((await call(app, admin, 'DELETE', '/v1/keys/old')).statusCode).toBe(204);
    expect((await call(app, admin, 'GET', '/v1/keys/old')).statusCode).toBe(404);
  });

  it('lets an encrypt call pin keyVersion, never below minEncryptionVersion nor above the latest', async () => {
    await call(app, admin, 'POST', '/v1/keys/pinned');
    await call(app, admin, 'POST', '/v1/keys/pinned/rotate');
    await call(app, admin, 'POST', '/v1/keys/pinned/rotate');
    const encryptAt = (keyVersion: number) => call(app, admin, 'POST', '/v1/encrypt/pinned', { items: ['x'], keyVersion });
    expect((await encryptAt(1)).json().results[0].ciphertext).toMatch(/^kf:v1:/);
    expect((await call(app, admin, 'PATCH', '/v1/keys/pinned', { minEncryptionVersion: 2 })).json().minEncryptionVersion).toBe(2);
    for (const refused of [1, 4]) {
      const res = await encryptAt(refused);
      expect(res.statusCode).toBe(400);
      expect(res.json().error.code).toBe('KF_KEY_VERSION_INVALID');
    }
    const v2 = (await encryptAt(2)).json().results[0].ciphertext;
    expect(v2).toMatch(/^kf:v2:/);
    expect((await results(app, admin, 'decrypt', 'pinned', { items: [v2] }))[0]!.plaintext).toBe('x');
    expect((await results(app, admin, 'encrypt', 'pinned', { items: ['x'] }))[0]!.ciphertext).toMatch(/^kf:v3:/);
    expect((await call(app, admin, 'PATCH', '/v1/keys/pinned', { minEncryptionVersion: 4 })).statusCode).toBe(400);
    expect((await call(app, admin, 'POST', '/v1/decrypt/pinned', { items: [v2], keyVersion: 2 })).statusCode).toBe(400);

    // Nor below minDecryptionVersion, whatever minEncryptionVersion says: it would seal what
    // could not be opened.
    await call(app, admin, 'PATCH', '/v1/keys/pinned', { minEncryptionVersion: 1, minDecryptionVersion: 3 });
    const belowOpening = await encryptAt(2);
    expect(belowOpening.statusCode).toBe(400);
    expect(belowOpening.json().error).toMatchObject({ code: 'KF_KEY_VERSION_INVALID', message: expect.stringContaining('between 3') });
    expect((await encryptAt(3)).json().results[0].ciphertext).toMatch(/^kf:v3:/);
  });

  it('keeps trimmed versions trimmed: neither minimum comes back down over deleted material', async () => {
    await call(app, admin, 'POST', '/v1/keys/trimmed');
    await call(app, admin, 'POST', '/v1/keys/trimmed/rotate');
    await call(app, admin, 'POST', '/v1/keys/trimmed/rotate');
    const [v1] = await results(app, admin, 'encrypt', 'trimmed', { items: ['one'], keyVersion: 1 });
    await call(app, admin, 'PATCH', '/v1/keys/trimmed', { minDecryptionVersion: 3 });
    // minEncryptionVersion (1) is raised with it: neither minimum names a version that is gone.
    expect((await call(app, admin, 'POST', '/v1/keys/trimmed/trim', { minAvailableVersion: 3 })).json()).toMatchObject({ minDecryptionVersion: 3, minEncryptionVersion: 3 });
    const before = (await call(app, admin, 'GET', '/v1/keys/trimmed')).json();
    for (const body of [{ minDecryptionVersion: 1 }, { minDecryptionVersion: 2 }, { minEncryptionVersion: 1 }, { minDecryptionVersion: 3, minEncryptionVersion: 2 }]) {
      const res = await call(app, admin, 'PATCH', '/v1/keys/trimmed', body);
      expect(res.statusCode, JSON.stringify(body)).toBe(400);
      expect(res.json().error).toEqual({ code: 'KF_KEY_VERSION_INVALID', message: 'that version was trimmed: its material is gone' });
    }
    expect((await call(app, admin, 'GET', '/v1/keys/trimmed')).json()).toEqual(before);
    expect((await results(app, admin, 'decrypt', 'trimmed', { items: [v1!.ciphertext!] }))[0]!.error!.code).toBe('KF_KEY_VERSION_DISABLED');
    // A client that sends back what GET gave, with one change, is not refused.
    const { minDecryptionVersion, minEncryptionVersion } = before;
    expect((await call(app, admin, 'PATCH', '/v1/keys/trimmed', { minDecryptionVersion, minEncryptionVersion, deletionAllowed: true })).json()).toMatchObject({ ...before, deletionAllowed: true });
  });

  it('refuses empty and invalid policy changes with 400, and a refused change changes nothing', async () => {
    await call(app, admin, 'POST', '/v1/keys/policy');
    await call(app, admin, 'POST', '/v1/keys/policy/rotate');
    const before = (await call(app, admin, 'GET', '/v1/keys/policy')).json();
    const bodies = [{}, { autoRotatePeriod: -1 }, { deletionAllowed: 'yes' }, { minDecryptionVersion: 5 }, { minDecryptionVersion: 2, minEncryptionVersion: 5 }, { minEncryptionVersion: 3, deletionAllowed: true }];
    for (const body of bodies) {
      const res = await call(app, admin, 'PATCH', '/v1/keys/policy', body);
      expect(res.statusCode, JSON.stringify(body)).toBe(400);
    }
    expect((await call(app, admin, 'GET', '/v1/keys/policy')).json()).toEqual(before);
  });
});

describe('key changes reach every process at once', () => {
  // Cached copies trusted for ten minutes: only the announcement of a change can make a process
  // see it within a test's time.
  const { env, admin } = testEnv({ KEY_CACHE_TTL_MS: '600000', SYNC_MAX_ITEMS: '100', CHUNK_ITEMS: '40' });
  /** Runs `attempt` until it gives true, every 20 ms for at most 3 s; whether it did. */
  const soon = async (attempt: () => Promise<boolean>): Promise<boolean> => {
    for (let i = 0; i < 150; i++) {
      if (await attempt()) return true;
      await sleep(20);
    }
    return false;
  };
  // The store's parts, for the tests that stand in for a process of their own.
  const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
  const master = new MasterKey(Buffer.from(env['KEYFLEET_MASTER_KEY']!, 'base64'));

  it('a key deleted and made again under its name is what every API and worker seals under next, not a cached copy of the old one', async () => {
    const [a, b] = [await api(env), await api(env)];
    workers.push(await startWorker(env));
    const make = async () => {
      expect((await call(a, admin, 'POST', '/v1/keys/phoenix')).statusCode).toBe(201);
      await call(a, admin, 'PATCH', '/v1/keys/phoenix', { deletionAllowed: true });
    };
    const batch = async (items: string[]) => {
      const id = (await call(a, admin, 'POST', '/v1/encrypt/phoenix', { items, mode: 'async' })).json().batchId;
      expect(await waitFor(a, admin, id)).toMatchObject({ status: 'completed', succeeded: items.length });
      return (await batchResults(a, admin, id)).map((l) => l.ciphertext as string);
    };
    await make();
    // API b and the worker each hold the first key now.
    await results(b, admin, 'encrypt', 'phoenix', { items: ['old'] });
    await batch(['old-1', 'old-2']);

    expect((await call(a, admin, 'DELETE', '/v1/keys/phoenix')).statusCode).toBe(204);
    await make();
    // API a made the change and forgot at once; b hears of it.
    const sealedByB = await soon(async () => {
      const [sealed] = await results(b, admin, 'encrypt', 'phoenix', { items: ['new'] });
      return (await results(a, admin, 'decrypt', 'phoenix', { items: [sealed!.ciphertext!] }))[0]!.plaintext === 'new';
    });
    expect(sealedByB).toBe(true);
    const items = Array.from({ length: 60 }, (_, i) => `new-${i}`);
    expect((await results(a, admin, 'decrypt', 'phoenix', { items: await batch(items) })).map((r) => r.plaintext ?? r.error!.code)).toEqual(items);
  });

  it('a rotation, and a raised minDecryptionVersion, made through one API hold in another at once', async () => {
    const [a, b] = [await api(env), await api(env)];
    await call(a, admin, 'POST', '/v1/keys/turning');
    const [v1] = await results(b, admin, 'encrypt', 'turning', { items: ['first'] });
    expect(v1!.ciphertext).toMatch(/^kf:v1:/);
    await call(a, admin, 'POST', '/v1/keys/turning/rotate');
    expect(await soon(async () => (await results(b, admin, 'encrypt', 'turning', { items: ['second'] }))[0]!.ciphertext!.startsWith('kf:v2:'))).toBe(true);
    await call(a, admin, 'PATCH', '/v1/keys/turning', { minDecryptionVersion: 2 });
    expect(await soon(async () => (await results(b, admin, 'decrypt', 'turning', { items: [v1!.ciphertext!] }))[0]!.error?.code === 'KF_KEY_VERSION_DISABLED')).toBe(true);
  });

  it('a change announced while a process was not listening is not missed: its cache starts over when it listens again', async () => {
    const url = env['REDIS_URL']!;
    const [own, other] = [new Redis(url), new Redis(url)];
    const name = `kft-sub-${randomBytes(4).toString('hex')}`;
    const subscriber = new Redis(url, { connectionName: name });
    const cache = new KeyCache(new KeyStore(own, keys, master), 600_000);
    const changes = new KeyChanges(subscriber, keys, cache);
    try {
      const elsewhere = new KeyStore(other, keys, master);
      await elsewhere.create('acme', 'unheard', { type: 'aes256-gcm96' });
      expect((await cache.get('acme', 'unheard')).latestVersion).toBe(1);
      // Announced: forgotten.
      await elsewhere.rotate('acme', 'unheard');
      expect(await soon(async () => (await cache.get('acme', 'unheard')).latestVersion === 2)).toBe(true);

      // The subscriber's connection is cut and the key rotates before it is back (ioredis waits
      // at least 50 ms before its first reconnect; a rotation takes a few): that announcement
      // reaches no one.
      const clients = (await own.call('CLIENT', 'LIST', 'TYPE', 'pubsub')) as string;
      const listed = [...clients.matchAll(/(?:^|\n)id=(\d+) .* name=(\S+)/g)].find((m) => m[2] === name);
      expect(listed).toBeDefined();
      await own.client('KILL', 'ID', listed![1]!);
      await elsewhere.rotate('acme', 'unheard');
      expect(await soon(async () => (await cache.get('acme', 'unheard')).latestVersion === 3)).toBe(true);
    } finally {
      changes.close();
      await Promise.all([own.quit(), other.quit()]);
    }
  });

  it('a subscription Redis refuses is said in the log and tried again until it holds', async () => {
    const user = `kft-deaf-${randomBytes(4).toString('hex')}`;
    const password = randomBytes(12).toString('hex');
    const root = new Redis(env['REDIS_URL']!);
    // Every command and key, no pub/sub channel: the SUBSCRIBE is refused (NOPERM).
    await root.call('ACL', 'SETUSER', user, 'on', `>${password}`, '~*', 'resetchannels', '+@all');
    const url = new URL(env['REDIS_URL']!);
    url.username = user;
    url.password = password;
    const lines: string[] = [];
    const log = createLogger({ level: 'info', name: 'test', destination: new Writable({ write: (chunk, _enc, done) => (lines.push(String(chunk)), done()) }) });
    const cache = new KeyCache(new KeyStore(root, keys, master), 600_000);
    const changes = new KeyChanges(new Redis(url.toString()), keys, cache, new ConnectionErrorLog(log));
    try {
      expect(await soon(async () => lines.some((l) => l.includes('key changes not heard: subscribe failed; retrying')))).toBe(true);
      expect(lines.join('')).not.toContain(password);
      const store = new KeyStore(root, keys, master);
      await store.create('acme', 'deaf', { type: 'aes256-gcm96' });
      expect((await cache.get('acme', 'deaf')).latestVersion).toBe(1);
      // Allowed now: the next try (within a second) holds, and drops what it may have missed.
      await root.call('ACL', 'SETUSER', user, 'allchannels');
      await store.rotate('acme', 'deaf');
      expect(await soon(async () => (await cache.get('acme', 'deaf')).latestVersion === 2)).toBe(true);
    } finally {
      changes.close();
      await root.call('ACL', 'DELUSER', user);
      await root.quit();
    }
  });
});

describe('master-key rotation', () => {
  it('runs with both master keys during the switch, rewraps every key under the new one, then needs only the new one', async () => {
    const { env, admin } = testEnv();
    const oldApp = await api(env);
    await call(oldApp, admin, 'POST', '/v1/keys/longlived');
    const v1 = (await results(oldApp, admin, 'encrypt', 'longlived', { items: ['before'] }))[0]!.ciphertext!;
    // A batch sealed at rest under the old master key, still queued.
    const queued = await oldApp.inject({ method: 'POST', url: '/v1/batches?op=encrypt&key=longlived', headers: { ...bearer(admin), 'content-type': 'application/x-ndjson' }, payload: '"queued during the switch"\n' });

    const newKey = randomBytes(32).toString('base64');
    const both = { ...env, KEYFLEET_MASTER_KEY: newKey, KEYFLEET_MASTER_KEY_PREVIOUS: env['KEYFLEET_MASTER_KEY']! };
    const switching = await api(both);
    expect((await results(switching, admin, 'decrypt', 'longlived', { items: [v1] }))[0]!.plaintext).toBe('before');
    await call(switching, admin, 'POST', '/v1/keys/longlived/rotate');
    const v2 = (await results(switching, admin, 'encrypt', 'longlived', { items: ['during'] }))[0]!.ciphertext!;

    const script = resolve(import.meta.dirname, '..', '..', 'dist', 'scripts', 'rotate-master-key.js');
    const output = execFileSync(process.execPath, [script], { env: { PATH: process.env['PATH'] ?? '', ...both, LOG_LEVEL: 'silent' } }).toString();
    expect(output).toMatch(/1 keys, 2 versions, 1 rewrapped under the new master key/);
    const fields = await redis.hgetall(`${env['KEYFLEET_PREFIX']}:key:acme:longlived`);
    expect(new Set([fields['m:1']!.split(':')[1], fields['m:2']!.split(':')[1]]).size).toBe(1);

    // The batch sealed under the old key still runs in a worker that accepts both.
    const worker = await startWorker(both);
    workers.push(worker);
    const done = await waitFor(switching, admin, queued.json().batchId);
    expect(done).toMatchObject({ status: 'completed', succeeded: 1 });

    const newOnly = await api({ ...env, KEYFLEET_MASTER_KEY: newKey });
    expect((await results(newOnly, admin, 'decrypt', 'longlived', { items: [v1, v2] })).map((r) => r.plaintext)).toEqual(['before', 'during']);
    // And the old master key alone no longer opens the key: it says so.
    const stale = await call(await api(env), admin, 'POST', '/v1/decrypt/longlived', { items: [v1] });
    expect(stale.json().error.code).toBe('KF_MASTER_KEY_MISMATCH');
  });
});
