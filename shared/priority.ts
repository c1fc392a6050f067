import { readdirSync } from 'node:fs';
import { setPriority } from 'node:os';

/**
 * Gives every thread of this process the niceness `nice` (0 = as the API, 19 = lowest); threads
 * started later inherit it from the thread that starts them. On Linux a priority belongs to a
 * thread, so each one listed in /proc/self/task (V8's and libuv's helpers too) is set; elsewhere
 * only the calling thread is. Returns false where lowering it is not permitted.
 */
export function lowerProcessPriority(nice: number): boolean {
  let threads: number[];
  try {
    threads = readdirSync('/proc/self/task').map(Number);
  } catch {
    threads = [0]; // 0: the calling thread
  }
  let lowered = true;
  for (const thread of threads) {
    try {
      setPriority(thread, nice);
    } catch (err) {
      // A helper thread may have ended since the listing; any other refusal is a real one.
      if ((err as { info?: { code?: string } }).info?.code !== 'ESRCH') lowered = false;
    }
  }
  return lowered;
}
