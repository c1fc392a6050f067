import { fork, spawn } from 'node:child_process';
import { join } from 'node:path';
import { setTimeout as delay } from 'node:timers/promises';
import type { LoadControl, LoadRequest, LoadResult, LoadStarted } from './loadgen.js';
import { makeItems } from './naive.js';
import { median, type Row } from './report.js';
import { freePort, stopChild, waitForOk } from '../scripts/local-net.js';
import { call, cpuSeconds, startStack, uploadBatch, waitForBatch, type Stack } from './stack.js';

interface Load {
  readonly rps: number;
  readonly p50: number;
  readonly p99: number;
  readonly errors: number;
  /** Share of one core the server process (all its threads) used while a fixed-length load ran. */
  readonly serverCpu?: number;
}

/** The process a load is sent to: the stack's API unless given. */
interface Server {
  readonly url: string;
  readonly pid: number;
}

/** One round of the sync section: the four loads, measured in turn. */
interface Round {
  readonly hello: Load;
  readonly health: Load;
  readonly r1: Load;
  readonly r10: Load;
}

/** The span of a load that counts: from `start` settling to `end` settling. */
interface Window {
  readonly start: Promise<unknown>;
  readonly end: Promise<unknown>;
}

/** A window that has not closed by then fails the bench (a batch that never completes). */
const WINDOW_LIMIT_S = 300;

/**
 * 100 connections for `span` seconds, autocannon's own figures; or, for a window, the
 * responses that arrive within it (the load runs from before `start`, so connections are open
 * and warm, until `end`). The client runs in a process of its own (bench/loadgen.ts).
 */
async function load(stack: Stack, path: string, span: number | Window, body?: unknown, server: Server = { url: stack.url, pid: stack.api.pid! }): Promise<Load> {
  const window = typeof span === 'number' ? undefined : span;
  const client = fork(join(import.meta.dirname, 'loadgen.js'), { stdio: ['ignore', 'ignore', 'inherit', 'ipc'] });
  let cpuBefore = cpuSeconds(server.pid);
  let clock = performance.now();
  const answered = new Promise<LoadResult>((resolve, reject) => {
    client.on('message', (message: LoadStarted | LoadResult) => {
      if (message.type === 'result') return resolve(message);
      cpuBefore = cpuSeconds(server.pid);
      clock = performance.now();
    });
    client.once('exit', (code) => reject(new Error(`${path}: the load generator exited (${code}) without a result`)));
  });
  const request: LoadRequest = {
    type: 'start',
    url: server.url + path,
    ...(window ? {} : { seconds: span as number }),
    limitSeconds: WINDOW_LIMIT_S,
    headers: { authorization: `Bearer ${stack.token}`, 'content-type': 'application/json' },
    ...(body ? { body: JSON.stringify(body) } : {}),
  };
  client.send(request);
  if (window) {
    const send = (control: LoadControl) => () => void (client.connected && client.send(control));
    // Settled either way: a failed batch closes the window too, and its caller sees the failure.
    window.start.then(send({ type: 'open' }), send({ type: 'open' }));
    window.end.then(send({ type: 'close' }), send({ type: 'close' }));
  }
  const result = await answered.finally(() => client.kill());
  if (result.failure) throw new Error(`${path}: ${result.failure}`);
  const measured = { rps: result.rps, p50: result.p50, p99: result.p99, errors: result.errors };
  return window ? measured : { ...measured, serverCpu: (cpuSeconds(server.pid) - cpuBefore) / ((performance.now() - clock) / 1000) };
}

/** How long a windowed load runs before its window opens: connections open and warm. */
const WARM_MS = 1_000;

/** A window of `seconds` that opens once the load has warmed up. */
function warmWindow(seconds: number): Window {
  const start = delay(WARM_MS);
  return { start, end: start.then(() => delay(seconds * 1_000)) };
}

/** A bare fastify hello-world in its own process (bench/hello.ts), listening on loopback. */
async function startHello(): Promise<Server & { stop(): Promise<void> }> {
  const port = await freePort();
  const child = spawn(process.execPath, [join(import.meta.dirname, 'hello.js'), String(port)], { stdio: ['ignore', 'ignore', 'inherit'] });
  const url = `http://127.0.0.1:${port}`;
  const stop = () => stopChild(child);
  await waitForOk(url, 'the hello-world server', child).catch(async (err: unknown) => {
    await stop();
    throw err;
  });
  return { url, pid: child.pid!, stop };
}

/**
 * The sync path under autocannon (100 connections): a bare fastify hello-world (the issue's
 * outside reference: what the machine and the load generator allow at all), healthz as the
 * reference for our own routes, then 1-item and 10-item encrypt, in `rounds` rounds of the
 * four in turn. A shared machine's speed drifts over tens of seconds; measured in turn, each
 * round's ratios compare loads that ran moments apart. Reported: the median round (by the
 * 10-item ratio: its figures, ratios and server CPU), with ranges over all rounds.
 */
export async function syncBench(seconds: number, rounds: number): Promise<Row[]> {
  const stack = await startStack();
  const hello = await startHello().catch(async (err: unknown) => {
    await stack.stop();
    throw err;
  });
  try {
    await call(stack, 'POST', '/v1/keys/bench');
    const one = { items: makeItems(1, 'sync') };
    const ten = { items: makeItems(10, 'sync') };
    await load(stack, '/v1/encrypt/bench', 1, ten); // warm up
    await load(stack, '/', 1, undefined, hello);
    const measured: Round[] = [];
    for (let round = 0; round < rounds; round++) {
      const bare = await load(stack, '/', seconds, undefined, hello);
      const health = await load(stack, '/healthz', seconds);
      const r1 = await load(stack, '/v1/encrypt/bench', seconds, one);
      const r10 = await load(stack, '/v1/encrypt/bench', seconds, ten);
      const errors = bare.errors + health.errors + r1.errors + r10.errors;
      if (errors > 0) throw new Error(`sync bench: ${errors} failed requests`);
      measured.push({ hello: bare, health, r1, r10 });
    }
    const ratio = (m: Round, r: Load) => r.rps / m.health.rps;
    const byRatio = [...measured].sort((a, b) => ratio(a, a.r10) - ratio(b, b.r10));
    const { hello: bare, health, r1, r10 } = byRatio[Math.floor((byRatio.length - 1) / 2)]!;
    /** The range of one figure over the rounds, for the notes (nothing for a single round). */
    const range = (pick: (m: Round) => number, digits: number, unit: string): string | undefined => {
      if (rounds === 1) return undefined;
      const values = measured.map(pick);
      return `${rounds} rounds: ${Math.min(...values).toFixed(digits)}–${Math.max(...values).toFixed(digits)}${unit}`;
    };
    const note = (...parts: Array<string | undefined>) => parts.filter(Boolean).join('; ');
    const cpu = (l: Load) => `server process ${Math.round(100 * l.serverCpu!)}% of a core`;
    return [
      {
        section: 'sync', name: 'fastify hello-world, bare, own process (the issue measured ~70k req/s on its machine; ratio: its req/s over healthz\'s)', value: bare.rps, unit: 'req/s', reference: health.rps, ratio: bare.rps / health.rps,
        note: note(`p50 ${bare.p50} ms, p99 ${bare.p99} ms`, cpu(bare), range((m) => m.hello.rps / 1000, 1, 'k req/s'), range((m) => m.hello.p99, 0, ' ms p99')),
      },
      { section: 'sync', name: 'GET /healthz (reference)', value: health.rps, unit: 'req/s', reference: health.rps, ratio: 1, note: note(`p50 ${health.p50} ms, p99 ${health.p99} ms`, cpu(health), range((m) => m.health.rps / 1000, 1, 'k req/s'), range((m) => m.health.p99, 0, ' ms p99')) },
      { section: 'sync', name: 'encrypt 1 item', value: r1.rps, unit: 'req/s', reference: health.rps, ratio: r1.rps / health.rps, note: note(`p50 ${r1.p50} ms, p99 ${r1.p99} ms`, cpu(r1), range((m) => ratio(m, m.r1), 2, '×')) },
      { section: 'sync', name: 'encrypt 10 items', value: r10.rps, unit: 'req/s', reference: health.rps, ratio: r10.rps / health.rps, note: note(`p50 ${r10.p50} ms, p99 ${r10.p99} ms`, cpu(r10), range((m) => ratio(m, m.r10), 2, '×')) },
      { section: 'sync', name: 'encrypt 10 items, p99', value: r10.p99, unit: 'ms', note: note(range((m) => m.r10.p99, 0, ' ms')) },
    ];
  } finally {
    await Promise.all([stack.stop(), hello.stop()]);
  }
}

/** How the worker process yields to the API (WORKER_NICE, WORKER_SCHED). */
export interface WorkerScheduling {
  readonly nice: number;
  readonly sched: 'idle' | 'normal';
}

const described = ({ nice, sched }: WorkerScheduling) => (sched === 'idle' ? `worker at SCHED_IDLE (nice ${nice})` : `worker at nice ${nice}`);

interface Isolation {
  readonly idle: Load;
  /** The load while one batch runs, upload to completion. */
  readonly during: Load;
  readonly batchMs: number;
  /** The load while batches run back to back for the whole window (when measured). */
  readonly busy?: Load & { readonly batches: number };
}

/**
 * 10-item encrypt under load idle, then for exactly as long as one batch of `batchItems` runs
 * (upload to completion), then (when `backToBack`) with batches back to back for `seconds`.
 */
async function measureIsolation(seconds: number, batchItems: number, { nice, sched }: WorkerScheduling, backToBack: boolean): Promise<Isolation> {
  const stack = await startStack({ WORKER_NICE: String(nice), WORKER_SCHED: sched });
  try {
    await call(stack, 'POST', '/v1/keys/bench');
    const ten = { items: makeItems(10, 'sync') };
    await load(stack, '/v1/encrypt/bench', 1, ten); // warm up
    // Idle, during and back to back measured alike: responses within a window that opens once
    // the load's connections are warm.
    const idle = await load(stack, '/v1/encrypt/bench', warmWindow(seconds), ten);
    const body = Buffer.from(makeItems(batchItems, 'iso').map((s) => `"${s}"`).join('\n') + '\n');
    const runBatch = async (): Promise<void> => {
      await waitForBatch(stack, await uploadBatch(stack, 'op=encrypt&key=bench', body));
    };
    let batchMs = 0;
    const warm = delay(WARM_MS);
    const one = warm.then(async () => {
      const started = Date.now();
      await runBatch();
      batchMs = Date.now() - started;
    });
    const during = await load(stack, '/v1/encrypt/bench', { start: warm, end: one }, ten);
    await one;
    let busy: Isolation['busy'];
    if (backToBack) {
      let running = true;
      let batches = 0;
      const feeder = (async () => {
        while (running) {
          await runBatch();
          batches++;
        }
      })();
      const measured = await load(stack, '/v1/encrypt/bench', warmWindow(seconds), ten);
      running = false;
      await feeder;
      busy = { ...measured, batches };
    }
    const errors = idle.errors + during.errors + (busy?.errors ?? 0);
    if (errors > 0) throw new Error(`isolation bench: ${errors} failed requests`);
    return { idle, during, batchMs, ...(busy ? { busy } : {}) };
  } finally {
    await stack.stop();
  }
}

/**
 * Isolation: 10-item encrypt p99 while one batch of `batchItems` runs, and while batches run
 * back to back, against the same load idle, with the worker process (event loop and threads)
 * at the given scheduling.
 */
export async function isolationBench(seconds: number, batchItems: number, scheduling: WorkerScheduling): Promise<Row[]> {
  const { idle, during, batchMs, busy } = await measureIsolation(seconds, batchItems, scheduling, true);
  const items = batchItems.toLocaleString('en-US');
  return [
    { section: 'isolation', name: `encrypt 10 items p99 during one ${items}-item batch, ${described(scheduling)}`, value: during.p99, unit: 'ms', reference: idle.p99, ratio: during.p99 / idle.p99, note: `idle p99 ${idle.p99} ms; the batch took ${(batchMs / 1000).toFixed(1)} s; ${Math.round(during.rps)} vs ${Math.round(idle.rps)} req/s` },
    { section: 'isolation', name: `encrypt 10 items p99 while ${items}-item batches run back to back, ${described(scheduling)}`, value: busy!.p99, unit: 'ms', reference: idle.p99, ratio: busy!.p99 / idle.p99, note: `idle p99 ${idle.p99} ms; ${busy!.batches} batches back to back through the load; ${Math.round(busy!.rps)} vs ${Math.round(idle.rps)} req/s` },
  ];
}

/**
 * Two schedulings side by side (`--only=isolation-ab`): `rounds` rounds, each measuring one
 * batch under both, `a` first in even rounds and `b` first in odd ones, so both see the same
 * spell of a shared machine in either order. Reported: the median p99 during the batch against
 * the median idle p99, each round's ratio, and in how many rounds `a`'s p99 during the batch
 * was the lower.
 */
export async function isolationAb(rounds: number, seconds: number, batchItems: number, a: WorkerScheduling, b: WorkerScheduling): Promise<Row[]> {
  const runs: Array<[Isolation, Isolation]> = [];
  for (let round = 0; round < rounds; round++) {
    const swapped = round % 2 === 1;
    const first = await measureIsolation(seconds, batchItems, swapped ? b : a, false);
    const second = await measureIsolation(seconds, batchItems, swapped ? a : b, false);
    runs.push(swapped ? [second, first] : [first, second]);
  }
  const items = batchItems.toLocaleString('en-US');
  const rowOf = (which: 0 | 1, scheduling: WorkerScheduling): Row => {
    const p99 = runs.map((r) => r[which].during.p99);
    const idle = median(runs.map((r) => r[which].idle.p99));
    const ratios = runs.map((r) => r[which].during.p99 / r[which].idle.p99);
    return {
      section: 'isolation', name: `median 10-item p99 during one ${items}-item batch over ${rounds} rounds, against the median idle p99 (${seconds} s idle), ${described(scheduling)}`,
      value: median(p99), unit: 'ms', reference: idle, ratio: median(p99) / idle,
      note: `during: ${p99.join(', ')} ms; each round against its idle p99: ${ratios.map((x) => x.toFixed(2)).join(', ')}×, within 2× in ${ratios.filter((x) => x <= 2).length} of ${rounds}`,
    };
  };
  const aLower = runs.filter(([x, y]) => x.during.p99 < y.during.p99).length;
  return [rowOf(0, a), rowOf(1, b), { section: 'isolation', name: `rounds where the ${described(a)} had the lower p99 during the batch`, value: aLower, unit: `of ${rounds}` }];
}
