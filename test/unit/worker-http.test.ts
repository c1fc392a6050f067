import { Registry } from 'prom-client';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { startWorkerHttp } from '../../worker/http-server.js';

let server: Awaited<ReturnType<typeof startWorkerHttp>>['server'];
let base: string;

beforeAll(async () => {
  const started = await startWorkerHttp({ host: '127.0.0.1', port: 0, registry: new Registry(), ready: async () => true });
  server = started.server;
  base = `http://127.0.0.1:${started.port}`;
});
afterAll(() => new Promise<void>((done) => server.close(() => done())));

describe("a worker's own HTTP server", () => {
  it('serves its three paths to GET and HEAD', async () => {
    for (const path of ['/metrics', '/healthz', '/readyz']) {
      expect((await fetch(base + path)).status, path).toBe(200);
      expect((await fetch(base + path, { method: 'HEAD' })).status, path).toBe(200);
    }
  });

  it('answers another method on them 405 with Allow, and a path it has not 404, in the API’s error format', async () => {
    const refused = await fetch(`${base}/metrics`, { method: 'POST', body: 'x' });
    expect([refused.status, refused.headers.get('allow'), await refused.json()]).toEqual([405, 'GET, HEAD', { error: { code: 'KF_METHOD_NOT_ALLOWED', message: 'the route does not take this method (Allow lists those it takes)' } }]);
    for (const method of ['GET', 'POST']) {
      const missing = await fetch(`${base}/nope`, { method });
      expect([missing.status, await missing.json()], method).toEqual([404, { error: { code: 'KF_NOT_FOUND', message: 'no such route' } }]);
    }
  });
});
