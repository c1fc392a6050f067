import type { Redis, RedisKeys } from '../shared/redis.js';

type Listener = (event: string) => void;

/** Delivered to every listener when the API shuts down, so open event streams end. */
export const SHUTDOWN = 'shutdown';

/**
 * Fans batch events (published by the scripts that change a batch) out to SSE streams.
 * One subscriber connection per API process; a channel is subscribed while anyone listens.
 */
export class BatchEvents {
  readonly #sub: Redis;
  readonly #keys: RedisKeys;
  readonly #listeners = new Map<string, Set<Listener>>();

  constructor(subscriber: Redis, keys: RedisKeys) {
    this.#sub = subscriber;
    this.#keys = keys;
    subscriber.on('message', (channel: string, message: string) => {
      for (const listener of this.#listeners.get(channel) ?? []) listener(message);
    });
  }

  /** Listens to one batch's events; the returned function stops listening. */
  async subscribe(batchId: string, listener: Listener): Promise<() => void> {
    const channel = this.#keys.batchEvents(batchId);
    let set = this.#listeners.get(channel);
    if (!set) {
      set = new Set();
      this.#listeners.set(channel, set);
      await this.#sub.subscribe(channel);
    }
    set.add(listener);
    return () => {
      set.delete(listener);
      if (set.size === 0 && this.#listeners.get(channel) === set) {
        this.#listeners.delete(channel);
        this.#sub.unsubscribe(channel).catch(() => {});
      }
    };
  }

  /** Tells every listener the API is going away; their streams end and the server can close. */
  shutdown(): void {
    for (const set of [...this.#listeners.values()]) for (const listener of [...set]) listener(SHUTDOWN);
  }

  async close(): Promise<void> {
    this.shutdown();
    this.#listeners.clear();
    await this.#sub.quit();
  }
}
