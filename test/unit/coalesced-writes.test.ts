import Fastify from 'fastify';
import { afterEach, describe, expect, it } from 'vitest';
import { coalesceWrites } from '../../producer/coalesced-writes.js';
import { sendWhenDone } from '../../producer/idempotency.js';

describe('responses written at the end of their turn', () => {
  const app = Fastify();
  coalesceWrites(app);
  const answered: string[] = [];
  app.get('/item/:n', async (request) => ({ n: Number((request.params as { n: string }).n) }));
  app.addHook('onResponse', async (request) => void answered.push(request.url));
  afterEach(() => void (answered.length = 0));

  it('writes every response made ready in one turn, each with its own body', async () => {
    const address = await app.listen({ host: '127.0.0.1', port: 0 });
    try {
      const bodies = await Promise.all(Array.from({ length: 50 }, (_, n) => fetch(`${address}/item/${n}`).then((r) => r.json())));
      expect(bodies).toEqual(Array.from({ length: 50 }, (_, n) => ({ n })));
      expect(answered).toHaveLength(50);
    } finally {
      await app.close();
    }
  });

  it('sends what a held write throws to the error handler (500), not a hung request', async () => {
    const other = Fastify();
    coalesceWrites(other);
    // The header is checked as the response is written, after the hook: the write throws.
    other.get('/bad-header', async (_request, reply) => reply.header('x-bad', 'a\nb').send('never'));
    let timer: NodeJS.Timeout | undefined;
    try {
      const bad = await Promise.race([
        other.inject({ method: 'GET', url: '/bad-header' }),
        new Promise<never>((_resolve, reject) => (timer = setTimeout(() => reject(new Error('no answer in 2 s')), 2_000))),
      ]);
      expect(bad.statusCode).toBe(500);
    } finally {
      clearTimeout(timer);
      await other.close();
    }
  });
});

describe('handlers that send for themselves (sendWhenDone)', () => {
  const app = Fastify();
  coalesceWrites(app);
  app.get('/answer', (_request, reply) => sendWhenDone(reply, Promise.resolve('{"ok":true}')));
  app.get('/teapot', (_request, reply) => sendWhenDone(reply, Promise.reject(Object.assign(new Error('short and stout'), { statusCode: 418 }))));
  app.get('/not-an-error', (_request, reply) => sendWhenDone(reply, Promise.reject('a string')));
  // The header is checked as the held response is written: the send fails after the hook.
  app.get('/bad-header', (_request, reply) => sendWhenDone(reply, Promise.resolve().then(() => (reply.header('x-bad', 'a\nb'), 'never'))));

  it('sends the answer once, errors through the error handler, and never leaves a request hanging', async () => {
    const address = await app.listen({ host: '127.0.0.1', port: 0 });
    const get = async (path: string) => {
      const response = await fetch(address + path, { signal: AbortSignal.timeout(2_000) });
      return { status: response.status, body: await response.text() };
    };
    try {
      // Twenty at once: each answered once, with its own body.
      const answers = await Promise.all(Array.from({ length: 20 }, () => get('/answer')));
      expect(answers).toEqual(Array.from({ length: 20 }, () => ({ status: 200, body: '{"ok":true}' })));
      const teapot = await get('/teapot');
      expect(teapot.status).toBe(418);
      expect(JSON.parse(teapot.body)).toMatchObject({ message: 'short and stout' });
      const notAnError = await get('/not-an-error');
      expect(notAnError.status).toBe(500);
      expect((await get('/bad-header')).status).toBe(500);
    } finally {
      await app.close();
    }
  });
});
