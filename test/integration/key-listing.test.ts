import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KeyfleetClient } from '../../client/index.js';
import { RedisKeys } from '../../shared/redis.js';
import { call, TestApis } from '../helpers/apps.js';
import { testEnv } from '../helpers/env.js';
import { startApi, type RunningProcess } from '../helpers/processes.js';

const { env, admin, encryptOnly, other } = testEnv();
const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
const apis = new TestApis();
const redis = new Redis(env['REDIS_URL']!);
let app: FastifyInstance;
/** An API process (the in-process app does not listen): it checks the key index as it starts. */
let apiProcess: RunningProcess | undefined;
let apiUrl = '';
const startApiProcess = async (): Promise<RunningProcess> => {
  const started = await startApi(env);
  apiProcess = started;
  apiUrl = started.url;
  return started;
};
beforeAll(async () => {
  app = await apis.start(env);
});
afterAll(async () => {
  await apiProcess?.stop();
  await apis.close();
  await redis.quit();
});

const names = async (url: string, who = admin): Promise<{ names: string[]; next?: string }> => {
  const res = await call(app, who, 'GET', url);
  expect(res.statusCode, res.body).toBe(200);
  const body = res.json() as { keys: Array<{ name: string }>; next?: string };
  return { names: body.keys.map((k) => k.name), ...(body.next !== undefined ? { next: body.next } : {}) };
};

describe('listing keys', () => {
  it('lists the tenant’s keys in name order with their metadata, a page at a time, and no other tenant’s', async () => {
    for (const name of ['orders', 'a.legacy-serials', 'tokens', 'Zeta']) expect((await call(app, admin, 'POST', `/v1/keys/${name}`)).statusCode).toBe(201);
    await call(app, admin, 'POST', '/v1/keys/tokens/rotate');
    expect((await call(app, other, 'POST', '/v1/keys/globex-only')).statusCode).toBe(201);

    const all = await call(app, admin, 'GET', '/v1/keys');
    expect(all.json().next).toBeUndefined();
    expect(all.json().keys).toEqual([
      expect.objectContaining({ name: 'Zeta', type: 'aes256-gcm96', latestVersion: 1 }),
      expect.objectContaining({ name: 'a.legacy-serials', latestVersion: 1 }),
      expect.objectContaining({ name: 'orders', latestVersion: 1 }),
      expect.objectContaining({ name: 'tokens', latestVersion: 2, minDecryptionVersion: 1 }),
    ]);
    // Metadata only, as GET /v1/keys/{name} gives it: no material.
    expect(all.json().keys[3]).toEqual((await call(app, admin, 'GET', '/v1/keys/tokens')).json());

    expect(await names('/v1/keys?limit=2')).toEqual({ names: ['Zeta', 'a.legacy-serials'], next: 'a.legacy-serials' });
    expect(await names('/v1/keys?limit=2&after=a.legacy-serials')).toEqual({ names: ['orders', 'tokens'] });
    expect(await names('/v1/keys?after=tokens')).toEqual({ names: [] });
    // `after` need not be a key's name.
    expect(await names('/v1/keys?after=b')).toEqual({ names: ['orders', 'tokens'] });
    expect(await names('/v1/keys', other)).toEqual({ names: ['globex-only'] });
  });

  it('drops a deleted key from the list, and lists it again once made again', async () => {
    await call(app, admin, 'POST', '/v1/keys/short-lived');
    expect((await names('/v1/keys')).names).toContain('short-lived');
    await call(app, admin, 'PATCH', '/v1/keys/short-lived', { deletionAllowed: true });
    expect((await call(app, admin, 'DELETE', '/v1/keys/short-lived')).statusCode).toBe(204);
    expect((await names('/v1/keys')).names).not.toContain('short-lived');
    await call(app, admin, 'POST', '/v1/keys/short-lived');
    expect((await names('/v1/keys')).names).toContain('short-lived');
  });

  it('refuses a bad page size, a bad `after` or an unknown parameter with 400 KF_VALIDATION, and a token without the keys scope with 403', async () => {
    for (const query of ['limit=0', 'limit=1001', 'limit=ten', 'limit=-1', 'limit=', 'after=a:b', 'after=', 'cursor=x']) {
      const res = await call(app, admin, 'GET', `/v1/keys?${query}`);
      expect(res.statusCode, query).toBe(400);
      expect(res.json().error.code, query).toBe('KF_VALIDATION');
    }
    const refused = await call(app, encryptOnly, 'GET', '/v1/keys');
    expect(refused.statusCode).toBe(403);
  });

  it('lists keys made before the index once an API process has started, and not a key deleted since', async () => {
    // As an API from before the index left them: hashes with no entry in the tenant's index.
    await call(app, admin, 'POST', '/v1/keys/made-before');
    await call(app, admin, 'POST', '/v1/keys/deleted-before');
    await redis.zrem(keys.keyIndex(admin.tenant), 'made-before', 'deleted-before');
    await redis.del(keys.key(admin.tenant, 'deleted-before'));
    expect((await names('/v1/keys')).names).not.toContain('made-before');

    const started = await startApiProcess();
    const checked = JSON.parse(await started.waitFor(/"msg":"key index checked"/, 20_000)) as { keys: number; indexed: number };
    expect(checked.indexed).toBe(1);
    const listed = (await names('/v1/keys')).names;
    expect(listed).toContain('made-before');
    expect(listed).not.toContain('deleted-before');
  });

  it('leaves out and unlists a name whose key an API from before the index deleted, but not one made again since', async () => {
    await call(app, admin, 'POST', '/v1/keys/deleted-by-old');
    await call(app, admin, 'POST', '/v1/keys/made-again');
    // As an old API deletes: the hash goes, the name stays listed.
    await redis.del(keys.key(admin.tenant, 'deleted-by-old'));
    expect((await names('/v1/keys')).names).not.toContain('deleted-by-old');
    expect(await redis.zscore(keys.keyIndex(admin.tenant), 'deleted-by-old')).toBeNull();
    expect(await redis.zscore(keys.keyIndex(admin.tenant), 'made-again')).not.toBeNull();
  });

  it('gives every key through the client, page by page', async () => {
    if (!apiProcess) await startApiProcess();
    const client = new KeyfleetClient({ url: apiUrl, token: admin.token });
    const listed: string[] = [];
    for await (const info of client.allKeys({ pageSize: 2 })) listed.push(info.name);
    expect(listed).toEqual((await names('/v1/keys?limit=1000')).names);
    expect(listed.length).toBeGreaterThan(4);
  });
});
