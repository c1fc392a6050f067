import { readdirSync } from 'node:fs';
import { constants, setPriority } from 'node:os';
import { nativeKernel } from './crypto/native-kernel.js';

/** How a worker yields the CPU to an API on the same cores (WORKER_NICE, WORKER_SCHED). */
export interface WorkerPriority {
  /** Niceness: 0 = as the API, 19 = lowest. */
  readonly nice: number;
  /**
   * Linux's SCHED_IDLE policy as well: a CPU weight of 3, against 15 at nice 19, so the threads
   * get a far smaller share of a core the API wants. It needs the native addon (Node sets
   * niceness only); without it, niceness alone.
   */
  readonly idle: boolean;
}

/** What lowering achieved. */
export interface Lowered {
  /** Every thread has the niceness asked for. */
  readonly nice: boolean;
  /** Every thread is under SCHED_IDLE (false where it was not asked for). */
  readonly idle: boolean;
  /** Why SCHED_IDLE is not in force, where it was asked for. */
  readonly idleRefused?: string;
}

const { ESRCH } = constants.errno;
const errnoName = (code: number) => Object.entries(constants.errno).find(([, value]) => value === code)?.[0] ?? `errno ${code}`;

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
  if (!idle) return { nice: niced, idle: false };
  if (process.platform !== 'linux') return { nice: niced, idle: false, idleRefused: 'not Linux' };
  // An addon built before setIdleScheduling existed loads, and lacks it.
  if (typeof nativeKernel?.setIdleScheduling !== 'function') return { nice: niced, idle: false, idleRefused: 'the native addon is not built, or is older than WORKER_SCHED' };
  const rc = nativeKernel.setIdleScheduling(thread);
  return rc === 0 || rc === ESRCH ? { nice: niced, idle: true } : { nice: niced, idle: false, idleRefused: `sched_setscheduler: ${errnoName(rc)}` };
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
  const refused = each.find((l) => l.idleRefused !== undefined)?.idleRefused;
  return { nice: each.every((l) => l.nice), idle: priority.idle && each.every((l) => l.idle), ...(refused ? { idleRefused: refused } : {}) };
}
