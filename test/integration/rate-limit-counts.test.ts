import { Redis } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { createServer } from 'node:net';
import { setTimeout as sleep } from 'node:timers/promises';
import { afterAll, describe, expect, inject, it } from 'vitest';
import { ExchangedCounts } from '../../producer/plugins/rate-limit.js';

const WINDOW_MS = 1_000;
const EXCHANGE_MS = 20;

/** Counts one request; the answer must come before incr returns (no request waits on Redis). */
function count(store: ExchangedCounts, key: string): number {
  let current: number | undefined;
  store.incr(key, (err, result) => {
    expect(err).toBeNull();
    current = result!.current;
  });
  expect(current).toBeDefined();
  return current!;
}

const nextWindow = (): Promise<void> => sleep(WINDOW_MS - (Date.now() % WINDOW_MS) + 5);

describe('the rate limiter’s counts, exchanged through Redis', () => {
  const redis = new Redis(inject('redisUrl'));
  const namespace = `{kft-${randomBytes(4).toString('hex')}}:rate:`;
  const stores: ExchangedCounts[] = [];
  const replica = (client: Redis = redis): ExchangedCounts => {
    const store = new ExchangedCounts(client, namespace, { windowMs: WINDOW_MS, exchangeMs: EXCHANGE_MS });
    stores.push(store);
    return store;
  };
  afterAll(async () => {
    for (const store of stores) store.close();
    await redis.quit();
  });

  /** Until Redis holds `total` for the key (an exchange went through), and its sender has read the answer. */
  const stored = async (key: string, window: number, total: number): Promise<void> => {
    for (let i = 0; i < 400 && Number(await redis.get(`${namespace}${key}:${window}`)) !== total; i++) await sleep(5);
    expect(Number(await redis.get(`${namespace}${key}:${window}`))).toBe(total);
    await sleep(EXCHANGE_MS);
  };

  it('counts at once in each replica, and each hears the others’ counts after an exchange', async () => {
    const [a, b] = [replica(), replica()];
    for (let attempt = 1; ; attempt++) {
      await nextWindow();
      const window = Math.floor(Date.now() / WINDOW_MS);
      const key = `tenant-${attempt}sync`;
      const first = [1, 2, 3, 4].map(() => count(a, key));
      await stored(key, window, 4);
      const bFirst = count(b, key); // b has not heard a's 4 yet
      await stored(key, window, 5);
      const bNext = count(b, key); // b heard 5 with its first exchange
      await stored(key, window, 6);
      const aNext = count(a, key); // a has not heard b's yet: its own 4 and this one
      await stored(key, window, 7);
      const aLast = count(a, key); // a heard 7 (4 + 2 of b's + its fifth)
      await stored(key, window, 8);
      const pttl = await redis.pttl(`${namespace}${key}:${window}`);
      if (Math.floor(Date.now() / WINDOW_MS) !== window && attempt < 3) continue;
      expect(first).toEqual([1, 2, 3, 4]);
      expect([bFirst, bNext, aNext, aLast]).toEqual([1, 6, 5, 8]);
      expect(pttl).toBeGreaterThan(0);
      expect(pttl).toBeLessThanOrEqual(2 * WINDOW_MS);
      break;
    }
  });

  it('keeps its own counts when Redis loses the window’s key (a restart, a failover)', async () => {
    const store = replica();
    for (let attempt = 1; ; attempt++) {
      await nextWindow();
      const window = Math.floor(Date.now() / WINDOW_MS);
      const key = `lost-${attempt}`;
      const before = [1, 2, 3].map(() => count(store, key));
      await stored(key, window, 3);
      await redis.del(`${namespace}${key}:${window}`);
      const after = count(store, key); // 4: Redis now counts 1 from nothing
      await stored(key, window, 1);
      const next = count(store, key); // still its own 4, and this one
      if (Math.floor(Date.now() / WINDOW_MS) !== window && attempt < 3) continue;
      expect([...before, after, next]).toEqual([1, 2, 3, 4, 5]);
      break;
    }
  });

  it('starts every window afresh, and keeps tenants apart', async () => {
    const store = replica();
    await nextWindow();
    expect([count(store, 'one'), count(store, 'one'), count(store, 'two')]).toEqual([1, 2, 1]);
    await nextWindow();
    expect(count(store, 'one')).toBe(1);
  });

  it('takes only routes that share a group’s budget in its window', () => {
    const store = replica();
    expect(store.child({ groupId: 'sync', timeWindow: WINDOW_MS } as never)).toBe(store);
    expect(() => store.child({ timeWindow: WINDOW_MS } as never)).toThrow(/groupId/);
    expect(() => store.child({ groupId: 'sync', timeWindow: 60_000 } as never)).toThrow(/window/);
  });

  it('goes on counting alone, without waiting, when Redis does not answer', async () => {
    // A port that accepts nothing: every exchange fails.
    const closed = createServer();
    await new Promise<void>((resolve) => closed.listen(0, '127.0.0.1', resolve));
    const port = (closed.address() as { port: number }).port;
    await new Promise<void>((resolve) => closed.close(() => resolve()));
    const away = new Redis({ port, host: '127.0.0.1', lazyConnect: true, enableOfflineQueue: false, maxRetriesPerRequest: 0, retryStrategy: () => null });
    away.on('error', () => {});
    const store = replica(away);
    try {
      await nextWindow();
      expect([1, 2, 3].map(() => count(store, 'alone'))).toEqual([1, 2, 3]);
      await sleep(EXCHANGE_MS * 5); // the exchange fails: the three stay counted here
      expect(count(store, 'alone')).toBe(4);
    } finally {
      away.disconnect();
    }
  });
});
