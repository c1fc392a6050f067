import { Redis } from 'ioredis';
import { once } from 'node:events';
import { afterAll, describe, expect, it } from 'vitest';
import { BatchEvents } from '../../producer/batch-events.js';
import { RedisKeys } from '../../shared/redis.js';
import { testEnv } from '../helpers/env.js';

const { env } = testEnv();
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
});
