import { execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Client } from '../helpers/client.js';
import { testEnv } from '../helpers/env.js';
import { type ApiProcess, startApiAndWorker, type RunningProcess } from '../helpers/processes.js';

const { env, admin, encryptOnly } = testEnv({ CHUNK_ITEMS: '10000' });
let api: ApiProcess;
let worker: RunningProcess;
let client: Client;
const legacyKey = randomBytes(32);

beforeAll(async () => {
  [api, worker] = await startApiAndWorker(env);
  client = new Client(api.url, admin.token);
});
afterAll(async () => {
  await Promise.all([worker?.stop(), api?.stop()]);
});

const pkcs7 = (message: Buffer): Buffer => {
  const pad = 16 - (message.length % 16);
  return Buffer.concat([message, Buffer.alloc(pad, pad)]);
};

/**
 * Legacy ciphertexts made by the `openssl enc` command line, 100,000 of them in one run: every
 * message is PKCS#7-padded here and the stream is encrypted with -nopad. In CBC each message's
 * blocks are then encrypted with the previous message's last ciphertext block as their IV, so
 * (that block, the message's blocks) is exactly a standalone `openssl enc` ciphertext of it.
 */
function opensslLegacy(messages: string[]): string[] {
  const iv = randomBytes(16);
  const padded = messages.map((m) => pkcs7(Buffer.from(m, 'utf8')));
  const stream = execFileSync('openssl', ['enc', '-aes-256-cbc', '-nopad', '-K', legacyKey.toString('hex'), '-iv', iv.toString('hex')], { input: Buffer.concat(padded), maxBuffer: 64 * 1024 * 1024 });
  let at = 0;
  let previous = iv;
  return padded.map((p, n) => {
    const ct = stream.subarray(at, at + p.length);
    at += p.length;
    const item = n % 2 === 0 ? `${previous.toString('hex')}:${ct.toString('hex')}` : Buffer.concat([previous, ct]).toString('base64');
    previous = ct.subarray(ct.length - 16);
    return item;
  });
}

describe('migration from legacy AES-256-CBC', () => {
  it('imports the legacy key, which decrypts (decrypt scope only) and rewraps but never encrypts', async () => {
    const imported = await client.json('POST', '/v1/keys/legacy/import', { type: 'legacy-aes256-cbc', material: legacyKey.toString('base64') });
    expect(imported.status).toBe(201);
    expect(imported.body).toMatchObject({ name: 'legacy', type: 'legacy-aes256-cbc', latestVersion: 1 });
    expect(JSON.stringify(imported.body)).not.toContain(legacyKey.toString('base64'));
    // Material is never replaced, and only legacy keys take imported material.
    expect((await client.json('POST', '/v1/keys/legacy/import', { type: 'legacy-aes256-cbc', material: randomBytes(32).toString('base64') })).status).toBe(409);
    expect((await client.json('POST', '/v1/keys/other/import', { type: 'aes256-gcm96', material: randomBytes(32).toString('base64') })).status).toBe(400);

    const samples = opensslLegacy(['LIC-0001', 'LIC-0002 ✓']);
    const opened = await client.json('POST', '/v1/decrypt/legacy', { items: [...samples, samples[0]!.slice(0, -2), 'garbage'] });
    expect(opened.body.results.map((r: any) => r.plaintext ?? r.error.code)).toEqual(['LIC-0001', 'LIC-0002 ✓', 'KF_DECRYPT_FAILED', 'KF_DECRYPT_FAILED']);
    const encrypt = await client.json('POST', '/v1/encrypt/legacy', { items: ['new'] });
    expect(encrypt.status).toBe(400);
    expect(encrypt.body.error.code).toBe('KF_KEY_OPERATION_UNSUPPORTED');
    const noScope = await fetch(`${client.base}/v1/decrypt/legacy`, { method: 'POST', headers: { authorization: `Bearer ${encryptOnly.token}`, 'content-type': 'application/json' }, body: JSON.stringify({ items: samples }) });
    expect(noScope.status).toBe(403);
  });

  it('rewraps legacy ciphertexts into a modern key synchronously with targetKey, the plaintext never leaving', async () => {
    expect((await client.json('POST', '/v1/keys/serials')).status).toBe(201);
    const samples = opensslLegacy(['SN-1', 'SN-2']);
    const rewrapped = await client.json('POST', '/v1/rewrap/legacy', { items: samples, targetKey: 'serials' });
    expect(rewrapped.status).toBe(200);
    const cts = rewrapped.body.results.map((r: any) => r.ciphertext);
    for (const ct of cts) expect(ct).toMatch(/^kf:v1:/);
    expect(JSON.stringify(rewrapped.body)).not.toContain('SN-1');
    expect((await client.json('POST', '/v1/decrypt/serials', { items: cts })).body.results.map((r: any) => r.plaintext)).toEqual(['SN-1', 'SN-2']);
    expect((await client.json('POST', '/v1/rewrap/legacy', { items: samples })).body.error.code).toBe('KF_KEY_OPERATION_UNSUPPORTED');
    expect((await client.json('POST', '/v1/encrypt/serials', { items: ['x'], targetKey: 'legacy' })).body.error.code).toBe('KF_TARGET_KEY_INVALID');
    expect((await client.json('POST', '/v1/rewrap/serials', { items: cts, targetKey: 'legacy' })).body.error.code).toBe('KF_KEY_OPERATION_UNSUPPORTED');
  });

  it('migrates a legacy file of 100,000 openssl-made items through a rewrap batch into an aes256-gcm96 key, every item decrypting to its original', async () => {
    const originals = Array.from({ length: 100_000 }, (_, i) => `LEGACY-SN-${String(i).padStart(6, '0')}-${(i * 7919) % 100_003}`);
    const legacy = opensslLegacy(originals);
    expect(legacy.filter((l) => l.includes(':')).length).toBe(50_000); // both shapes, half each

    const submitted = await client.uploadNdjson('rewrap', 'legacy', legacy, '&targetKey=serials');
    expect(submitted.status).toBe(202);
    const done = await client.waitForBatch(submitted.body.batchId);
    expect(done).toMatchObject({ status: 'completed', total: 100_000, succeeded: 100_000, failed: 0 });
    const migrated = await client.results(submitted.body.batchId);
    expect(migrated.map((l) => l.i)).toEqual(originals.map((_, i) => i));
    for (const line of migrated.slice(0, 1000)) expect(line.ciphertext).toMatch(/^kf:v1:/);

    const back = await client.uploadNdjson('decrypt', 'serials', migrated.map((l) => l.ciphertext!));
    expect((await client.waitForBatch(back.body.batchId)).succeeded).toBe(100_000);
    expect((await client.results(back.body.batchId)).map((l) => l.plaintext)).toEqual(originals);
    // Nothing of the migration's plaintexts or key material reached the logs.
    const logs = [...api.lines, ...worker.lines].join('\n');
    for (const secret of [originals[0]!, originals[99_999]!, legacyKey.toString('base64'), legacyKey.toString('hex')]) expect(logs.includes(secret)).toBe(false);
  });
});
