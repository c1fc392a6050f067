import { spawn, type ChildProcess } from 'node:child_process';
import { resolve } from 'node:path';
import { createInterface } from 'node:readline';
import { API_NODE_FLAGS } from '../../producer/node-flags.js';

const root = resolve(import.meta.dirname, '..', '..');

export interface RunningProcess {
  readonly child: ChildProcess;
  /** Every line the process wrote to stdout and stderr so far (pino JSON lines). */
  readonly lines: string[];
  /** The lines of stdout alone, and of stderr alone. */
  readonly stdout: string[];
  readonly stderr: string[];
  /** Resolves with the first line matching `pattern`, waiting up to `timeoutMs`. */
  waitFor(pattern: RegExp, timeoutMs?: number): Promise<string>;
  /** SIGTERM, then SIGKILL after `graceMs`; resolves with the exit code (null when killed). */
  stop(graceMs?: number): Promise<number | null>;
  kill(): Promise<void>;
  readonly exited: Promise<number | null>;
}

/** Runs a built entry (`dist/…`, or in another copy of `dist`) as a real process, as production does. */
export function runEntry(entry: 'producer/main.js' | 'worker/main.js', env: Record<string, string>, dist = resolve(root, 'dist')): RunningProcess {
  const flags = entry === 'producer/main.js' ? API_NODE_FLAGS : [];
  const child = spawn(process.execPath, [...flags, resolve(dist, entry)], { env: { PATH: process.env['PATH'] ?? '', ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
  const lines: string[] = [];
  const stdout: string[] = [];
  const stderr: string[] = [];
  const waiters: Array<{ pattern: RegExp; done: (line: string) => void }> = [];
  const onLine = (stream: string[]) => (line: string): void => {
    if (!line) return;
    lines.push(line);
    stream.push(line);
    for (const w of [...waiters]) {
      if (w.pattern.test(line)) {
        waiters.splice(waiters.indexOf(w), 1);
        w.done(line);
      }
    }
  };
  // Whole lines per stream, however the pipe splits them between reads.
  createInterface({ input: child.stdout!, crlfDelay: Infinity }).on('line', onLine(stdout));
  createInterface({ input: child.stderr!, crlfDelay: Infinity }).on('line', onLine(stderr));
  // 'close', not 'exit': it comes once the output is read to the end, so `lines` is complete.
  const exited = new Promise<number | null>((done) => child.once('close', (code) => done(code)));

  return {
    child,
    lines,
    stdout,
    stderr,
    exited,
    waitFor(pattern, timeoutMs = 20_000) {
      const seen = lines.find((l) => pattern.test(l));
      if (seen) return Promise.resolve(seen);
      return new Promise((ok, fail) => {
        const timer = setTimeout(() => fail(new Error(`${entry}: no line matching ${pattern} within ${timeoutMs} ms; last lines:\n${lines.slice(-10).join('\n')}`)), timeoutMs);
        waiters.push({ pattern, done: (l) => (clearTimeout(timer), ok(l)) });
        exited.then(() => {
          clearTimeout(timer);
          fail(new Error(`${entry} exited before printing ${pattern}; last lines:\n${lines.slice(-10).join('\n')}`));
        });
      });
    },
    async stop(graceMs = 15_000) {
      if (child.exitCode !== null || child.signalCode !== null) return exited;
      child.kill('SIGTERM');
      const timer = setTimeout(() => child.kill('SIGKILL'), graceMs);
      const code = await exited;
      clearTimeout(timer);
      return code;
    },
    async kill() {
      if (child.exitCode !== null || child.signalCode !== null) {
        await exited;
        return;
      }
      child.kill('SIGKILL');
      await exited;
    },
  };
}

/** Waits for `pattern`; a process that does not get there is killed, so no test leaves it behind. */
async function started(running: RunningProcess, pattern: RegExp): Promise<RunningProcess> {
  try {
    await running.waitFor(pattern);
    return running;
  } catch (err) {
    await running.kill();
    throw err;
  }
}

/** Starts a worker process and waits until it takes chunks. */
export function startWorker(env: Record<string, string>): Promise<RunningProcess> {
  return started(runEntry('worker/main.js', { ...env, LOG_LEVEL: 'info' }), /"msg":"worker started"/);
}

/** An API process, and the address it listens on. */
export interface ApiProcess extends RunningProcess {
  readonly port: number;
  /** `http://127.0.0.1:<port>` */
  readonly url: string;
}

/**
 * Starts an API process and waits until it listens. It listens on a port the system picks (PORT=0)
 * and read back from its log, so no other process can take the port between a pick and the bind.
 */
export async function startApi(env: Record<string, string>): Promise<ApiProcess> {
  const running = await started(runEntry('producer/main.js', { ...env, LOG_LEVEL: 'info', HOST: '127.0.0.1', PORT: '0' }), /Server listening/);
  const listening = /Server listening at http:\/\/127\.0\.0\.1:(\d+)/.exec(await running.waitFor(/Server listening/));
  if (!listening) {
    await running.kill();
    throw new Error(`producer/main.js: no port in its listening line; last lines:\n${running.lines.slice(-10).join('\n')}`);
  }
  const port = Number(listening[1]);
  return Object.assign(running, { port, url: `http://127.0.0.1:${port}` });
}

/** Starts an API and a worker side by side; if either fails, the other is stopped too. */
export async function startApiAndWorker(env: Record<string, string>): Promise<[ApiProcess, RunningProcess]> {
  const [api, worker] = await Promise.allSettled([startApi(env), startWorker(env)]);
  if (api.status === 'fulfilled' && worker.status === 'fulfilled') return [api.value, worker.value];
  await Promise.all([api, worker].map((o) => (o.status === 'fulfilled' ? o.value.kill() : undefined)));
  throw api.status === 'rejected' ? api.reason : (worker as PromiseRejectedResult).reason;
}
