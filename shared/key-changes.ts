import type { KeyCache } from './key-cache.js';
import type { Redis, RedisKeys } from './redis.js';

/**
 * Hears the key store's announcements (a key made, rotated, its policy changed, trimmed or
 * deleted: key-store.ts) and has this process's key cache forget that key, so the change reaches
 * every API and worker process at once rather than when its cached copy's KEY_CACHE_TTL_MS ends.
 * Without it a process that had cached a key deleted and made again under the same name went on
 * sealing under the old material, which nothing could open once its copy expired.
 *
 * Pub/sub keeps no message for a subscriber that is away: each time the connection is ready
 * (at start and after a reconnect) the channel is subscribed again and, once it is, the whole
 * cache is dropped. The TTL remains the bound for a change announced in between.
 */
export class KeyChanges {
  readonly #sub: Redis;

  constructor(subscriber: Redis, keys: RedisKeys, cache: KeyCache) {
    this.#sub = subscriber;
    const channel = keys.keyChanges;
    subscriber.on('message', (from: string, redisKey: string) => {
      if (from !== channel) return;
      const key = keys.keyOf(redisKey);
      if (key) cache.forget(key.tenant, key.name);
    });
    // ioredis subscribes again by itself after a reconnect, but says nothing when it has: this
    // SUBSCRIBE is sent after its own, so once it is answered, both are in place.
    const listen = () => subscriber.subscribe(channel).then(() => cache.clear(), () => {});
    subscriber.on('ready', listen);
  }

  /** Stops listening (the connection is this object's). */
  close(): void {
    // Not QUIT: while Redis is unreachable it would wait behind the queued SUBSCRIBEs for ever.
    this.#sub.disconnect();
  }
}
