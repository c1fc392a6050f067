import { readdirSync } from 'node:fs';
import { setPriority } from 'node:os';
import { nativeKernel } from './crypto/native-kernel.js';

/** How a worker yields the CPU to an API on the same cores (WORKER_NICE, WORKER_SCHED). */
export interface WorkerPriority {
  /** Niceness: 0 = as the API, 19 = lowest. */
  readonly nice: number;
  /**
   * Linux's SCHED_IDLE policy as well: the threads run only when a core would otherwise be
   * idle. It needs the native addon (Node sets niceness only); without it, niceness alone.
   */
  readonly idle: boolean;
}

/** What lowering achieved: the niceness, and whether SCHED_IDLE is in force. */
export interface Lowered {
  readonly nice: boolean;
  readonly idle: boolean;
}

const ESRCH = 3;

/**
 * Lowers one thread (0: the calling one). A thread that ended meanwhile counts as lowered:
 * it competes with nothing any more.
 */
export function lowerThreadPriority(thread: number, { nice, idle }: WorkerPriority): Lowered {
  let niced = true;
  try {
    setPriority(thread, nice);
  } catch (err) {
    niced = (err as { info?: { code?: string } }).info?.code === 'ESRCH';
  }
  if (!idle || !nativeKernel || process.platform !== 'linux') return { nice: niced, idle: false };
  const rc = nativeKernel.setIdleScheduling(thread);
  return { nice: niced, idle: rc === 0 || rc === ESRCH };
}

/**
 * Lowers every thread of this process; threads started later inherit it from the thread that
 * starts them. On Linux a priority belongs to a thread, so each one listed in /proc/self/task
 * (V8's and libuv's helpers too) is set; elsewhere only the calling thread is.
 */
export function lowerProcessPriority(priority: WorkerPriority): Lowered {
  let threads: number[];
  try {
    threads = readdirSync('/proc/self/task').map(Number);
  } catch {
    threads = [0];
  }
  const each = threads.map((thread) => lowerThreadPriority(thread, priority));
  return { nice: each.every((l) => l.nice), idle: priority.idle && each.every((l) => l.idle) };
}
