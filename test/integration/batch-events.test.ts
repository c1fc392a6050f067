import { Redis } from 'ioredis';
import { once } from 'node:events';
import { request } from 'node:http';
import { randomBytes } from 'node:crypto';
import { afterAll, describe, expect, it } from 'vitest';
import { buildApp } from '../../producer/app.js';
import { BatchEvents } from '../../producer/batch-events.js';
import { RedisKeys } from '../../shared/redis.js';
import { Client } from '../helpers/client.js';
import { configFrom, testEnv } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';

const { env, admin } = testEnv();
const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
const publisher = new Redis(env['REDIS_URL']!);
afterAll(async () => {
  await publisher.quit();
});

describe('batch events (Redis pub/sub behind the SSE streams)', () => {
  it('a SUBSCRIBE that failed is tried again by the next listener, which then hears the batch', async () => {
    // Not connected, and no offline queue: the first SUBSCRIBE is refused at once.
    const subscriber = new Redis(env['REDIS_URL']!, { lazyConnect: true, enableOfflineQueue: false });
    const events = new BatchEvents(subscriber, keys);
    try {
      await expect(events.subscribe('B1', () => {})).rejects.toThrow();
      // The refused command set off the lazy connection; once it is up, listeners may come.
      if (subscriber.status === 'wait') await subscriber.connect();
      else if (subscriber.status !== 'ready') await once(subscriber, 'ready');
      const heard = new Promise<string>((resolve) => void events.subscribe('B1', resolve).then(() => publisher.publish(keys.batchEvents('B1'), 'progress')));
      expect(await heard).toBe('progress');
    } finally {
      await events.close();
    }
  });

  it('ends a stream that registers after the shutdown began, once it has started', async () => {
    const events = new BatchEvents(new Redis(env['REDIS_URL']!, { lazyConnect: true }), keys);
    const ended: string[] = [];
    const forgetEarly = events.onShutdown(() => ended.push('early'));
    events.onShutdown(() => ended.push('forgotten'))();
    events.shutdown();
    expect(ended).toEqual(['early']);
    forgetEarly();
    events.onShutdown(() => ended.push('late'));
    expect(ended).toEqual(['early']); // not inside onShutdown: its caller is still setting up
    await Promise.resolve();
    expect(ended).toEqual(['early', 'late']);
    await events.close();
  });

  it('an SSE stream whose client left before the stream began (its batch read slowly) does not stay subscribed', async () => {
    const app = await buildApp({ config: configFrom(env) });
    // The handler is held until its client has gone, as a slow Redis holds its read of the batch.
    let arrived: () => void = () => {};
    const received = new Promise<void>((resolve) => (arrived = resolve));
    app.addHook('preHandler', async (request) => {
      if (!request.url.endsWith('/events')) return;
      arrived();
      if (!request.raw.socket.destroyed) await once(request.raw.socket, 'close');
    });
    try {
      const client = new Client(await app.listen({ host: '127.0.0.1', port: 0 }), admin.token);
      expect((await client.json('POST', '/v1/keys/leavers')).status).toBe(201);
      const { body } = await client.uploadNdjson('encrypt', 'leavers', ['left-early']); // no worker: it stays queued
      const req = request(`${client.base}/v1/batches/${body.batchId}/events`, { headers: { authorization: `Bearer ${admin.token}` }, agent: false });
      req.on('error', () => {}).end();
      await received;
      req.destroy();
      // The handler goes on once the API has seen the client go; nobody is there to listen to.
      const channel = keys.batchEvents(body.batchId);
      for (let i = 0; i < 30; i++) {
        const [, listeners] = (await publisher.call('PUBSUB', 'NUMSUB', channel)) as [string, number];
        expect(listeners).toBe(0);
        await new Promise((resolve) => setTimeout(resolve, 100));
      }
    } finally {
      await app.close();
    }
  });

  it('an SSE stream whose SUBSCRIBE Redis refuses follows the batch to its end by polling, and ends at shutdown', async () => {
    // The API's Redis user may do everything but subscribe.
    const user = `kft-nosub-${randomBytes(4).toString('hex')}`;
    const password = randomBytes(16).toString('hex');
    // SSUBSCRIBE exists from Redis 7 on (the README supports 6.2).
    const sharded = Number(/redis_version:(\d+)/.exec(await publisher.info('server'))?.[1]) >= 7 ? ['-ssubscribe'] : [];
    await publisher.acl('SETUSER', user, 'on', `>${password}`, '~*', '&*', '+@all', '-subscribe', '-psubscribe', ...sharded);
    const url = new URL(env['REDIS_URL']!);
    url.username = user;
    url.password = password;
    let probe: Redis | undefined;
    let worker: RunningProcess | undefined;
    let app: Awaited<ReturnType<typeof buildApp>> | undefined;
    try {
      probe = new Redis(url.toString());
      app = await buildApp({ config: configFrom({ ...env, REDIS_URL: url.toString() }) });
      await expect(probe.subscribe(keys.batchEvents('probe'))).rejects.toThrow(/NOPERM/);
      const client = new Client(await app.listen({ host: '127.0.0.1', port: 0 }), admin.token);
      expect((await client.json('POST', '/v1/keys/serials')).status).toBe(201);
      // No worker yet: the stream opens on a queued batch, and only a poll can see it end.
      const submitted = await client.uploadNdjson('encrypt', 'serials', Array.from({ length: 2_000 }, (_, i) => `poll-${i}`));
      expect(submitted.status).toBe(202);
      const res = await fetch(`${client.base}/v1/batches/${submitted.body.batchId}/events`, { headers: { authorization: `Bearer ${admin.token}` }, signal: AbortSignal.timeout(40_000) });
      const text = res.text(); // the server ends the stream after the final event
      text.catch(() => {}); // awaited below; a worker that fails to start must not leave it unhandled
      worker = await startWorker(env);
      const events = (await text).split('\n\n').filter((e) => e.startsWith('event:'));
      expect(events[0]).toMatch(/^event: progress\n/);
      expect(JSON.parse(events[0]!.split('data: ')[1]!)).toMatchObject({ status: 'queued', processed: 0 });
      expect(events.at(-1)).toMatch(/^event: done\n/);
      expect(JSON.parse(events.at(-1)!.split('data: ')[1]!)).toMatchObject({ status: 'completed', processed: 2_000 });

      // Shutdown ends such a stream too, though no SUBSCRIBE carries it: with the worker gone
      // this batch never ends, and the stream would hold the server's close for ever.
      await worker.stop();
      worker = undefined;
      const stuck = await client.uploadNdjson('encrypt', 'serials', ['never-run']);
      const open = await fetch(`${client.base}/v1/batches/${stuck.body.batchId}/events`, { headers: { authorization: `Bearer ${admin.token}` }, signal: AbortSignal.timeout(40_000) });
      const reader = open.body!.getReader();
      expect(new TextDecoder().decode((await reader.read()).value)).toMatch(/^event: progress\n/);
      // Two polls find the batch as it was: neither sends the same event again.
      const next = reader.read();
      const quiet = await Promise.race([next.then(({ value }) => new TextDecoder().decode(value)), new Promise((resolve) => setTimeout(resolve, 4_500, 'nothing'))]);
      expect(quiet).toBe('nothing');
      const closed = app.close().then(() => 'closed');
      const late = new Promise((resolve) => setTimeout(resolve, 10_000, 'still open after 10 s'));
      expect(await Promise.race([closed, late])).toBe('closed');
      app = undefined;
      while (!(await reader.read()).done); // the stream ended
    } finally {
      await worker?.stop();
      await app?.close();
      probe?.disconnect();
      await publisher.acl('DELUSER', user);
    }
  });
});
