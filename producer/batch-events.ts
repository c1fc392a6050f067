import type { Redis, RedisKeys } from '../shared/redis.js';

type Listener = (event: string) => void;

/**
 * Fans batch events (published by the scripts that change a batch) out to SSE streams.
 * One subscriber connection per API process; a channel is subscribed while anyone listens.
 */
export class BatchEvents {
  readonly #sub: Redis;
  readonly #keys: RedisKeys;
  /** Per channel: its listeners, and its SUBSCRIBE, which every listener waits for. */
  readonly #channels = new Map<string, { listeners: Set<Listener>; subscribed: Promise<unknown> }>();
  readonly #streams = new Set<() => void>();
  #shutDown = false;

  constructor(subscriber: Redis, keys: RedisKeys) {
    this.#sub = subscriber;
    this.#keys = keys;
    subscriber.on('message', (channel: string, message: string) => {
      for (const listener of this.#channels.get(channel)?.listeners ?? []) listener(message);
    });
  }

  /** Listens to one batch's events; the returned function stops listening. Rejects when Redis refuses the SUBSCRIBE. */
  async subscribe(batchId: string, listener: Listener): Promise<() => void> {
    const channel = this.#keys.batchEvents(batchId);
    let entry = this.#channels.get(channel);
    if (!entry) {
      const made = { listeners: new Set<Listener>(), subscribed: this.#sub.subscribe(channel) };
      this.#channels.set(channel, made);
      // A failed SUBSCRIBE is forgotten, so the next listener tries again.
      made.subscribed.catch(() => {
        if (this.#channels.get(channel) === made) this.#channels.delete(channel);
      });
      entry = made;
    }
    await entry.subscribed;
    const { listeners } = entry;
    listeners.add(listener);
    return () => {
      listeners.delete(listener);
      if (listeners.size === 0 && this.#channels.get(channel) === entry) {
        this.#channels.delete(channel);
        this.#sub.unsubscribe(channel).catch(() => {});
      }
    };
  }

  /**
   * Has `end` called at shutdown: every stream, also one whose SUBSCRIBE is still pending or was
   * refused (it follows its batch by polling). The returned function forgets it.
   */
  onShutdown(end: () => void): () => void {
    // A stream that was on its way in as the shutdown began ends as soon as it has started.
    if (this.#shutDown) queueMicrotask(end);
    else this.#streams.add(end);
    return () => void this.#streams.delete(end);
  }

  /** Tells every stream the API is going away; they end, and the server can close. */
  shutdown(): void {
    this.#shutDown = true;
    for (const end of [...this.#streams]) end();
  }

  async close(): Promise<void> {
    this.shutdown();
    this.#channels.clear();
    // Not QUIT: while Redis is unreachable it would wait behind the queued re-SUBSCRIBEs for ever
    // (this connection retries without limit), and a subscriber has nothing to flush.
    this.#sub.disconnect();
  }
}
