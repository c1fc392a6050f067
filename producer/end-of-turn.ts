let queued: Array<() => void> = [];

const runQueued = (): void => {
  const tasks = queued;
  queued = [];
  for (const task of tasks) task();
};

/**
 * Runs `task` at the end of this turn of the event loop (setImmediate), with every other task
 * queued in the turn: one Immediate for all of them, not one each. The held writes
 * (coalesced-writes.ts) and the body watches (body-timeout.ts) wait here, per request.
 */
export function atEndOfTurn(task: () => void): void {
  if (queued.length === 0) setImmediate(runQueued);
  queued.push(task);
}
