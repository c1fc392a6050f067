import type { FastifyInstance } from 'fastify';
import { Queue } from 'bullmq';
import { Redis } from 'ioredis';
import { createServer, type IncomingHttpHeaders, type Server } from 'node:http';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { verifyWebhookSignature } from '../../client/index.js';
import { buildApp } from '../../producer/app.js';
import { webhookJobId } from '../../shared/queue.js';
import { Client } from '../helpers/client.js';
import { configFrom, testEnv } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';

const SECRET = 'whsec_test_0123456789abcdef';
const { env, admin } = testEnv({ WEBHOOK_SECRET: SECRET, WEBHOOK_ALLOWED_HOSTS: '127.0.0.1' });
let app: FastifyInstance;
let worker: RunningProcess;
let client: Client;
let receiver: Server;
let receiverUrl: string;
interface Delivery {
  readonly headers: IncomingHttpHeaders;
  readonly body: string;
  readonly answered: number;
}
const deliveries: Delivery[] = [];
/** Answers queued for the next deliveries (then 200). */
const answers: number[] = [];

beforeAll(async () => {
  receiver = createServer((req, res) => {
    let body = '';
    req.setEncoding('utf8');
    req.on('data', (d) => (body += d));
    req.on('end', () => {
      const answered = answers.shift() ?? 200;
      deliveries.push({ headers: req.headers, body, answered });
      res.writeHead(answered).end();
    });
  });
  await new Promise<void>((ok) => receiver.listen(0, '127.0.0.1', ok));
  receiverUrl = `http://127.0.0.1:${(receiver.address() as { port: number }).port}/hooks/keyfleet`;
  app = await buildApp({ config: configFrom(env) });
  client = new Client(await app.listen({ host: '127.0.0.1', port: 0 }), admin.token);
  worker = await startWorker(env);
  expect((await client.json('POST', '/v1/keys/serials')).status).toBe(201);
});
afterAll(async () => {
  await worker?.stop();
  await app?.close();
  await new Promise((ok) => receiver?.close(ok));
});

async function deliveriesFor(batchId: string, count: number): Promise<Delivery[]> {
  // Up to 30 s: a retry is due 1 s after a failed attempt, but the host is shared and noisy.
  for (let i = 0; i < 600; i++) {
    const mine = deliveries.filter((d) => d.headers['keyfleet-delivery'] === batchId);
    if (mine.length >= count) return mine;
    await new Promise((r) => setTimeout(r, 50));
  }
  const got = deliveries.filter((d) => d.headers['keyfleet-delivery'] === batchId).map((d) => d.answered);
  throw new Error(`batch ${batchId}: ${got.length} of ${count} webhook deliveries (${got.join(', ')}); the worker's last lines:\n${worker.lines.slice(-15).join('\n')}`);
}

describe('webhooks', () => {
  it('POSTs the final status of a completed batch, signed; a receiver verifies the real signature, and a failed delivery is retried', async () => {
    answers.push(500); // the first attempt fails: the worker must try again
    const query = `&callbackUrl=${encodeURIComponent(receiverUrl)}`;
    const submitted = await client.uploadNdjson('encrypt', 'serials', Array.from({ length: 2_000 }, (_, i) => `S-${i}`), query);
    expect(submitted.status).toBe(202);
    const [first, second] = await deliveriesFor(submitted.body.batchId, 2);
    expect(first!.answered).toBe(500);
    expect(second!.answered).toBe(200);
    const status = JSON.parse(second!.body);
    expect(status).toMatchObject({ id: submitted.body.batchId, status: 'completed', total: 2_000, succeeded: 2_000 });
    expect(second!.headers['keyfleet-event']).toBe('batch.completed');
    expect(second!.headers['content-type']).toBe('application/json');

    const signature = second!.headers['keyfleet-signature'] as string;
    expect(signature).toMatch(/^t=\d+,v1=[0-9a-f]{64}$/);
    expect(verifyWebhookSignature(SECRET, signature, second!.body)).toBe(true);
    // A changed body, another secret, a stale timestamp or no header: refused.
    expect(verifyWebhookSignature(SECRET, signature, second!.body.replace('2000', '2001'))).toBe(false);
    expect(verifyWebhookSignature('whsec_someone_else_entirely', signature, second!.body)).toBe(false);
    expect(verifyWebhookSignature(SECRET, signature, second!.body, { now: Math.floor(Date.now() / 1000) + 3_600 })).toBe(false);
    expect(verifyWebhookSignature(SECRET, undefined, second!.body)).toBe(false);
    // The delivery names no secret: the status, as GET /v1/batches/{id} answers it.
    expect(Object.keys(status).sort()).toEqual(Object.keys((await client.json('GET', `/v1/batches/${submitted.body.batchId}`)).body).sort());
  });

  it('sends the cancelled status when a batch is deleted, once a worker is there to send it', async () => {
    await worker.stop(); // nothing runs: the batch stays queued until it is cancelled
    const submitted = await client.uploadNdjson('encrypt', 'serials', ['a', 'b'], `&callbackUrl=${encodeURIComponent(receiverUrl)}`);
    expect((await client.json('DELETE', `/v1/batches/${submitted.body.batchId}`)).status).toBe(200);
    // The API only queues the delivery; it waits in Redis for a worker.
    worker = await startWorker(env);
    const [delivery] = await deliveriesFor(submitted.body.batchId, 1);
    expect(JSON.parse(delivery!.body)).toMatchObject({ status: 'cancelled' });
    expect(verifyWebhookSignature(SECRET, delivery!.headers['keyfleet-signature'] as string, delivery!.body)).toBe(true);
  });

  it('a delivery being retried when its worker is stopped is sent by another worker, exactly once', async () => {
    answers.push(503); // the first attempt fails; the retry is due a second later
    const submitted = await client.uploadNdjson('encrypt', 'serials', Array.from({ length: 500 }, (_, i) => `R-${i}`), `&callbackUrl=${encodeURIComponent(receiverUrl)}`);
    expect(submitted.status).toBe(202);
    const batchId = submitted.body.batchId as string;
    const [first] = await deliveriesFor(batchId, 1);
    expect(first!.answered).toBe(503);
    // SIGTERM mid-retry (as a scale-down does), then a fresh worker.
    expect(await worker.stop()).toBe(0);
    worker = await startWorker(env);
    const [, second] = await deliveriesFor(batchId, 2);
    expect(second!.answered).toBe(200);
    expect(verifyWebhookSignature(SECRET, second!.headers['keyfleet-signature'] as string, second!.body)).toBe(true);
    expect(JSON.parse(second!.body)).toMatchObject({ id: batchId, status: 'completed', total: 500, succeeded: 500 });
    await worker.waitFor(/"msg":"webhook delivered"/);
    // Long enough for a second delivery job's first attempt (the old process's retry was due after 1 s).
    await new Promise((r) => setTimeout(r, 2_500));
    expect(deliveries.filter((d) => d.headers['keyfleet-delivery'] === batchId).map((d) => d.answered)).toEqual([503, 200]);
  });

  it('says so when a worker without WEBHOOK_SECRET ends a batch that asked for a webhook', async () => {
    await worker.stop();
    const { WEBHOOK_SECRET: _secret, ...unsigned } = env;
    const lacking = await startWorker(unsigned);
    try {
      const submitted = await client.uploadNdjson('encrypt', 'serials', ['a'], `&callbackUrl=${encodeURIComponent(receiverUrl)}`);
      const line = JSON.parse(await lacking.waitFor(/webhook not sent: WEBHOOK_SECRET is not set/));
      expect(line).toMatchObject({ level: 40, batchId: submitted.body.batchId, webhookHost: new URL(receiverUrl).host });
      expect(JSON.stringify(line)).not.toContain('/hooks/keyfleet');
    } finally {
      await lacking.stop();
      worker = await startWorker(env);
    }
  });

  it('refuses callback URLs that are not http(s), carry credentials, or name a host off the allow-list', async () => {
    for (const bad of ['ftp://127.0.0.1/x', 'file:///etc/passwd', 'javascript:alert(1)', 'http://user:pw@127.0.0.1/x', 'http://10.0.0.1/hook', 'http://example.com/hook', 'not a url']) {
      const res = await client.uploadNdjson('encrypt', 'serials', ['a'], `&callbackUrl=${encodeURIComponent(bad)}`);
      expect(res.status, bad).toBe(400);
      expect(res.body.error.code).toBe('KF_CALLBACK_URL_INVALID');
    }
    const viaSync = await client.json('POST', '/v1/encrypt/serials', { items: ['a'], mode: 'async', callbackUrl: 'gopher://127.0.0.1/' });
    expect(viaSync.status).toBe(400);
    expect(viaSync.body.error.code).toBe('KF_CALLBACK_URL_INVALID');
    // A request answered in the response gets the same verdict: it would the day it grew into a batch.
    for (const mode of ['auto', 'sync']) {
      const answered = await client.json('POST', '/v1/encrypt/serials', { items: ['a'], mode, callbackUrl: 'gopher://127.0.0.1/' });
      expect([answered.status, answered.body.error?.code], mode).toEqual([400, 'KF_CALLBACK_URL_INVALID']);
    }
    const allowed = await client.json('POST', '/v1/encrypt/serials', { items: ['a'], callbackUrl: receiverUrl });
    expect(allowed.status).toBe(200);
  });
});

describe('webhooks without an allow-list', () => {
  it('go to public addresses only: an internal address is refused at once, and a name that resolves to one is never connected to', async () => {
    const open = testEnv({ WEBHOOK_SECRET: SECRET });
    const apps: FastifyInstance[] = [];
    const webhookJobs = new Queue('webhooks', { connection: new Redis(open.env['REDIS_URL']!, { maxRetriesPerRequest: null }), prefix: open.env['KEYFLEET_PREFIX']! });
    let openWorker: RunningProcess | undefined;
    /** The webhook job of a batch, once it has run: its state and attempts. */
    const settled = async (batchId: string) => {
      for (let i = 0; i < 200; i++) {
        const job = await webhookJobs.getJob(webhookJobId(batchId));
        const state = job ? await job.getState() : 'missing';
        // Read again once settled: the job read before may have been still running (attempts 0).
        if (state === 'completed' || state === 'failed') return { state, attemptsMade: (await webhookJobs.getJob(webhookJobId(batchId)))!.attemptsMade };
        await new Promise((r) => setTimeout(r, 50));
      }
      throw new Error(`the webhook job of ${batchId} did not settle`);
    };
    try {
      const start = async (overrides: Record<string, string> = {}) => {
        const made = await buildApp({ config: configFrom({ ...open.env, ...overrides }) });
        apps.push(made);
        return new Client(await made.listen({ host: '127.0.0.1', port: 0 }), open.admin.token);
      };
      const openClient = await start();
      openWorker = await startWorker(open.env);
      expect((await openClient.json('POST', '/v1/keys/serials')).status).toBe(201);
      for (const bad of [receiverUrl, 'http://[::1]/hook', 'http://169.254.169.254/latest/meta-data/', 'http://10.0.0.1/hook']) {
        const res = await openClient.uploadNdjson('encrypt', 'serials', ['a'], `&callbackUrl=${encodeURIComponent(bad)}`);
        expect(res.status, bad).toBe(400);
        expect(res.body.error.code).toBe('KF_CALLBACK_URL_INVALID');
      }

      // The receiver by a name that resolves to loopback: accepted, then refused when resolved.
      const byName = receiverUrl.replace('127.0.0.1', 'localhost');
      const named = await openClient.uploadNdjson('encrypt', 'serials', ['a', 'b', 'c'], `&callbackUrl=${encodeURIComponent(byName)}`);
      expect(named.status).toBe(202);
      const namedId = named.body.batchId as string;
      expect((await openClient.waitForBatch(namedId)).status).toBe('completed');
      // One attempt, ended without a retry.
      expect(await settled(namedId)).toEqual({ state: 'completed', attemptsMade: 1 });
      expect(openWorker.lines.filter((l) => l.includes(namedId) && l.includes('webhook')).map((l) => JSON.parse(l).msg)).toEqual([
        'webhook not sent: its host resolves to no public address (not retried; WEBHOOK_ALLOWED_HOSTS may allow it)',
      ]);

      // A batch made by an API that allows the address (settings differ, or changed since):
      // the sending worker holds it to its own settings.
      const lenient = await start({ WEBHOOK_ALLOWED_HOSTS: '127.0.0.1' });
      const literal = await lenient.uploadNdjson('encrypt', 'serials', ['d'], `&callbackUrl=${encodeURIComponent(receiverUrl)}`);
      expect(literal.status).toBe(202);
      const literalId = literal.body.batchId as string;
      expect((await openClient.waitForBatch(literalId)).status).toBe('completed');
      expect(await settled(literalId)).toEqual({ state: 'completed', attemptsMade: 1 });
      expect(openWorker.lines.some((l) => l.includes(literalId) && l.includes('webhook not sent: its callbackUrl is not allowed here'))).toBe(true);

      // Nothing reached the receiver.
      expect(deliveries.filter((d) => [namedId, literalId].includes(d.headers['keyfleet-delivery'] as string))).toEqual([]);
    } finally {
      await openWorker?.stop();
      await Promise.all(apps.map((a) => a.close()));
      await webhookJobs.close();
      await webhookJobs.disconnect();
    }
  });
});
