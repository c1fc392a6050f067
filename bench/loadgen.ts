/**
 * The sync section's load generator, in a process of its own (forked by bench/sync.ts): a
 * client that shares its heap and event loop with the bench runner measures the runner's
 * garbage collections too, and by the sync section the runner has been through a million-item
 * end-to-end run. One load per process: `{ type: 'start', ... }` in; for a window, `open` and
 * `close` messages bound the responses that count; one `result` message out, then it exits.
 */
import autocannon from 'autocannon';

export interface LoadRequest {
  readonly type: 'start';
  readonly url: string;
  /** Seconds for a fixed-length load; absent for a window (bounded by `limitSeconds`). */
  readonly seconds?: number;
  readonly limitSeconds: number;
  readonly headers: Record<string, string>;
  readonly body?: string;
}

export type LoadControl = { readonly type: 'open' } | { readonly type: 'close' };

/** Sent as the load begins, so that the server's CPU is measured over the load alone. */
export interface LoadStarted {
  readonly type: 'started';
}

export interface LoadResult {
  readonly type: 'result';
  readonly rps: number;
  readonly p50: number;
  readonly p99: number;
  readonly errors: number;
  /** Set when a window was asked for and never closed, or saw no response. */
  readonly failure?: string;
}

const reply = (result: Omit<LoadResult, 'type'>): void => {
  process.send!({ type: 'result', ...result } satisfies LoadResult, () => process.exit(0));
};

process.once('message', (request: LoadRequest) => {
  const windowed = request.seconds === undefined;
  process.send!({ type: 'started' } satisfies LoadStarted);
  const instance = autocannon({
    url: request.url,
    connections: 100,
    duration: windowed ? request.limitSeconds : request.seconds!,
    method: request.body === undefined ? 'GET' : 'POST',
    headers: request.headers,
    ...(request.body === undefined ? {} : { body: request.body }),
  });
  if (!windowed) {
    void instance.then((r) => reply({ rps: r.requests.average, p50: r.latency.p50, p99: r.latency.p99, errors: r.errors + r.non2xx }));
    return;
  }
  // autocannon stops only at its next one-second tick, so its own figures would take in up to
  // a second beyond the window: the responses inside it are kept here instead.
  const tracker = instance as unknown as autocannon.Instance;
  const times: number[] = [];
  let started = Infinity;
  let ended = Infinity;
  tracker.on('response', (_client, _status, _bytes, responseTime) => {
    const now = performance.now();
    if (now >= started && now <= ended) times.push(responseTime);
  });
  process.on('message', (control: LoadControl) => {
    if (control.type === 'open') started = performance.now();
    else {
      ended = performance.now();
      tracker.stop();
    }
  });
  void instance.then((r) => {
    const errors = r.errors + r.non2xx;
    if (ended === Infinity) return reply({ rps: 0, p50: 0, p99: 0, errors, failure: `the measured window did not close within ${request.limitSeconds} s` });
    if (times.length === 0) return reply({ rps: 0, p50: 0, p99: 0, errors, failure: 'no response arrived within the measured window' });
    times.sort((x, y) => x - y);
    const at = (q: number) => Math.round(times[Math.max(0, Math.ceil(q * times.length) - 1)]!);
    reply({ rps: times.length / ((ended - started) / 1000), p50: at(0.5), p99: at(0.99), errors });
  });
});
