import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KeyfleetClient } from '../../client/index.js';
import { RedisKeys } from '../../shared/redis.js';
import { call } from '../helpers/apps.js';
import { buildApp } from '../../producer/app.js';
import { configFrom, testEnv, type TestTenant } from '../helpers/env.js';

// No worker: the batches stay queued, as listed.
const { env, admin, encryptOnly, other } = testEnv();
const keysOnly: TestTenant = { tenant: admin.tenant, token: `tok_${randomBytes(16).toString('hex')}` };
env['KEYFLEET_TOKENS'] += `,${keysOnly.tenant}:${keysOnly.token}:keys`;
const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
const redis = new Redis(env['REDIS_URL']!);
let app: FastifyInstance;
let url: string;
const made: string[] = []; // the admin tenant's batches, oldest first

const upload = async (who: TestTenant, op: string, items: string[]): Promise<string> => {
  const res = await call(app, who, 'POST', `/v1/batches?op=${op}&key=listed`, items.map((i) => JSON.stringify(i)).join('\n') + '\n', { 'content-type': 'application/x-ndjson' });
  expect(res.statusCode, res.body).toBe(202);
  return res.json().batchId as string;
};
const ids = async (query: string, who: TestTenant = admin): Promise<{ ids: string[]; next?: string }> => {
  const res = await call(app, who, 'GET', `/v1/batches${query}`);
  expect(res.statusCode, res.body).toBe(200);
  const body = res.json() as { batches: Array<{ id: string }>; next?: string };
  return { ids: body.batches.map((b) => b.id), ...(body.next !== undefined ? { next: body.next } : {}) };
};

beforeAll(async () => {
  app = await buildApp({ config: configFrom(env) });
  url = await app.listen({ host: '127.0.0.1', port: 0 });
  await call(app, admin, 'POST', '/v1/keys/listed');
  await call(app, other, 'POST', '/v1/keys/listed');
  made.push(await upload(admin, 'encrypt', ['a', 'b']));
  made.push(await upload(admin, 'decrypt', ['kf:v1:AAAA']));
  made.push(await upload(admin, 'encrypt', ['c']));
  made.push(await upload(admin, 'encrypt', ['d', 'e', 'f']));
  await upload(other, 'encrypt', ['globex']);
});
afterAll(async () => {
  await app?.close();
  await redis.quit();
});

describe('listing batches', () => {
  it('lists the tenant’s batches newest first, each as GET /v1/batches/{id} gives it, and no other tenant’s', async () => {
    const res = await call(app, admin, 'GET', '/v1/batches');
    expect(res.statusCode).toBe(200);
    const { batches, next } = res.json() as { batches: Array<{ id: string; op: string; total: number }>; next?: string };
    expect(next).toBeUndefined();
    expect(batches.map((b) => b.id)).toEqual([...made].reverse());
    expect(batches.map((b) => [b.op, b.total])).toEqual([['encrypt', 3], ['encrypt', 1], ['decrypt', 1], ['encrypt', 2]]);
    for (const batch of batches) expect(batch).toEqual((await call(app, admin, 'GET', `/v1/batches/${batch.id}`)).json());
    expect((await ids('', other)).ids).toHaveLength(1);
  });

  it('pages with limit and before, and the client reads every page', async () => {
    const newest = [...made].reverse();
    const first = await ids('?limit=3');
    expect(first).toEqual({ ids: newest.slice(0, 3), next: expect.stringMatching(/^\d+$/) });
    expect(await ids(`?limit=3&before=${first.next}`)).toEqual({ ids: newest.slice(3) });
    const client = new KeyfleetClient({ url, token: admin.token });
    const all: string[] = [];
    for await (const status of client.allBatches({ pageSize: 1 })) all.push(status.id);
    expect(all).toEqual(newest);
  });

  it('shows a token with an operation’s scope only the batches of that operation, and refuses one with neither that nor the batches scope', async () => {
    expect((await ids('', encryptOnly)).ids).toEqual([made[3], made[2], made[0]]);
    // Its cursor names no batch (the page's last may be one it cannot see).
    const paged = await ids('?limit=2', encryptOnly);
    expect(paged.ids).toEqual([made[3], made[2]]);
    expect(paged.next).not.toContain(made[2]);
    expect((await ids(`?limit=2&before=${paged.next}`, encryptOnly)).ids).toEqual([made[0]]);
    const refused = await call(app, keysOnly, 'GET', '/v1/batches');
    expect(refused.statusCode).toBe(403);
    expect(refused.json().error.code).toBe('KF_FORBIDDEN');
  });

  it('leaves out a batch whose record expired, and drops it from the index', async () => {
    const expired = await upload(admin, 'encrypt', ['soon gone']);
    expect((await ids('?limit=1')).ids).toEqual([expired]);
    await redis.del(keys.batch(expired));
    expect((await ids('')).ids).toEqual([...made].reverse());
    expect(await redis.zscore(keys.batchIndex(admin.tenant), expired)).toBeNull();
  });

  it('goes on from a page whose last batch has since expired and been dropped by another listing', async () => {
    const newest = [...made].reverse();
    const first = await ids('?limit=2');
    expect(first.ids).toEqual(newest.slice(0, 2));
    const kept = await redis.dumpBuffer(keys.batch(newest[1]!));
    await redis.del(keys.batch(newest[1]!));
    expect((await ids('')).ids).toEqual([newest[0], ...newest.slice(2)]);
    expect(await ids(`?before=${first.next}`)).toEqual({ ids: newest.slice(2) });
    // Back as it was, for the tests after.
    await redis.restore(keys.batch(newest[1]!), 0, kept!);
    await redis.zadd(keys.batchIndex(admin.tenant), Number(first.next), newest[1]!);
  });

  it('drops the oldest ids whose records expired as batches are made, with no listing', async () => {
    const index = keys.batchIndex(admin.tenant);
    const gone = `gone-${randomBytes(6).toString('hex')}`;
    await redis.zadd(index, 1, gone); // older than every batch, and no record
    await upload(admin, 'encrypt', ['x']);
    expect(await redis.zscore(index, gone)).toBeNull();
    expect(await redis.ttl(index)).toBe(-1); // no lifetime of its own: a batch's record may outlive any
  });

  it('refuses a bad page size, a `before` that is no page’s next, and an unknown parameter with 400 KF_VALIDATION', async () => {
    for (const query of ['limit=0', 'limit=1001', 'limit=many', 'before=not-a-batch-id-listed', 'before=-1', 'before=1.5', 'before=', 'since=2026-01-01']) {
      const res = await call(app, admin, 'GET', `/v1/batches?${query}`);
      expect(res.statusCode, query).toBe(400);
      expect(res.json().error.code, query).toBe('KF_VALIDATION');
    }
  });
});
