import type { KeyCache } from './key-cache.js';
import type { ConnectionErrorLog, Redis, RedisKeys } from './redis.js';

/** After a refused SUBSCRIBE, the next try. */
const RETRY_MS = 1_000;

/**
 * Hears the key store's announcements (a key made, rotated, its policy changed, trimmed or
 * deleted: key-store.ts) and has this process's key cache forget that key, so the change reaches
 * every API and worker process as soon as the message does, rather than when its cached copy's
 * KEY_CACHE_TTL_MS ends. Without it a process that had cached a key deleted and made again under
 * the same name went on sealing under the old material, which nothing could open once its copy
 * expired.
 *
 * Pub/sub keeps no message for a subscriber that is away: each time the connection is ready
 * (at start and after a reconnect) the channel is subscribed again and, once it is, the whole
 * cache is dropped. On Redis Cluster ioredis moves a lost subscription to another node without
 * a `ready`, so there, as for a change announced while the subscription was down, the TTL is
 * the bound.
 */
export class KeyChanges {
  readonly #sub: Redis;
  #retry: NodeJS.Timeout | undefined;
  #closed = false;

  constructor(subscriber: Redis, keys: RedisKeys, cache: KeyCache, errors?: ConnectionErrorLog) {
    this.#sub = subscriber;
    const channel = keys.keyChanges;
    subscriber.on('message', (from: string, redisKey: string) => {
      if (from !== channel) return;
      const key = keys.keyOf(redisKey);
      if (key) cache.forget(key.tenant, key.name);
    });
    // ioredis subscribes again by itself after a reconnect, but says nothing when it has: this
    // SUBSCRIBE is sent after its own, so once it is answered, both are in place.
    const listen = (): void => {
      clearTimeout(this.#retry);
      subscriber.subscribe(channel).then(
        () => cache.clear(),
        (err: Error) => {
          if (this.#closed) return;
          errors?.report('subscriber', err, 'key changes not heard: subscribe failed; retrying');
          this.#retry = setTimeout(listen, RETRY_MS).unref();
        },
      );
    };
    subscriber.on('ready', listen);
  }

  /** Stops listening (the connection is this object's). */
  close(): void {
    this.#closed = true;
    clearTimeout(this.#retry);
    // Not QUIT: while Redis is unreachable it would wait behind the queued SUBSCRIBEs for ever.
    this.#sub.disconnect();
  }
}
