import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { nativeKernel } from '../../shared/crypto/native-kernel.js';
import { testEnv } from '../helpers/env.js';
import { startApiAndWorker, type RunningProcess } from '../helpers/processes.js';

const running: RunningProcess[] = [];
afterAll(async () => {
  await Promise.all(running.map((p) => p.kill()));
});

const version = (JSON.parse(readFileSync(resolve(import.meta.dirname, '../../package.json'), 'utf8')) as { version: string }).version;

describe('start-up lines', () => {
  it('the API and the worker each say, as they start, their version, the Redis and prefix they use (no password) and how they are set up', async () => {
    // The test Redis's default user takes any password: one in the URL must not reach the log.
    const password = `pw-${Date.now()}`;
    const { env } = testEnv({ SYNC_MAX_ITEMS: '500', CHUNK_ITEMS: '2000' });
    env['REDIS_URL'] = env['REDIS_URL']!.replace('redis://', `redis://default:${password}@`);
    const [api, worker] = await startApiAndWorker(env);
    running.push(api, worker);
    const line = async (p: RunningProcess, msg: string) => JSON.parse(await p.waitFor(new RegExp(`"msg":"${msg}"`))) as Record<string, unknown>;
    const redis = env['REDIS_URL'].replace(`default:${password}@`, '…@');
    const kernel = nativeKernel ? 'native' : 'js';
    expect(await line(api, 'api started')).toMatchObject({
      level: 30, version, address: api.url, redis, prefix: env['KEYFLEET_PREFIX'], kernel, syncMaxItems: 500, chunkItems: 2000,
    });
    expect(await line(worker, 'worker started')).toMatchObject({ level: 30, version, redis, queue: expect.stringContaining(env['KEYFLEET_PREFIX']!), kernel });
    expect([...api.lines, ...worker.lines].filter((l) => l.includes(password))).toEqual([]);
  });
});
