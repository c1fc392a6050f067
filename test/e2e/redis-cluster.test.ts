import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { Client } from '../helpers/client.js';
import { testEnv } from '../helpers/env.js';
import { startApi, startWorker, type RunningProcess } from '../helpers/processes.js';
import { startCluster, type LocalCluster } from '../helpers/redis-cluster.js';

let cluster: LocalCluster;
const processes: RunningProcess[] = [];
let client: Client;

beforeAll(async () => {
  cluster = await startCluster();
  const { env, admin } = testEnv({ REDIS_URL: cluster.urls, REDIS_CLUSTER: 'true', KEYFLEET_PREFIX: '{keyfleet}', CHUNK_ITEMS: '2500' });
  const api = await startApi(env);
  processes.push(api);
  processes.push(await startWorker(env), await startWorker(env));
  client = new Client(api.url, admin.token);
});

afterAll(async () => {
  await Promise.all(processes.map((p) => p.stop()));
  await cluster?.stop();
});

describe('on a 3-master Redis Cluster', () => {
  it('runs keys, the sync path and a batch through API + 2 workers, every item exactly once', async () => {
    expect((await client.json('POST', '/v1/keys/clustered')).status).toBe(201);
    const [sealed] = (await client.json('POST', '/v1/encrypt/clustered', { items: ['hello'] })).body.results;
    expect((await client.json('POST', '/v1/decrypt/clustered', { items: [sealed.ciphertext] })).body.results).toEqual([{ plaintext: 'hello' }]);

    const originals = Array.from({ length: 50_000 }, (_, i) => `cluster-${i}`);
    const submitted = await client.uploadNdjson('encrypt', 'clustered', originals);
    expect(submitted.status).toBe(202);
    expect(await client.waitForBatch(submitted.body.batchId)).toMatchObject({ status: 'completed', processed: 50_000, succeeded: 50_000 });
    const lines = await client.results(submitted.body.batchId);
    expect(lines.map((l) => l.i)).toEqual(originals.map((_, i) => i));
    expect(new Set(lines.map((l) => l.ciphertext)).size).toBe(50_000);

    const back = await client.uploadNdjson('decrypt', 'clustered', lines.map((l) => l.ciphertext!));
    await client.waitForBatch(back.body.batchId);
    expect((await client.results(back.body.batchId)).map((l) => l.plaintext)).toEqual(originals);
    const events = await fetch(`${client.base}/v1/batches/${back.body.batchId}/events`, { headers: { authorization: `Bearer ${client.token}` } });
    expect(await events.text()).toContain('event: done');
  });
});
