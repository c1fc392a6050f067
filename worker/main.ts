import { lowerProcessPriority } from '../shared/priority.js';
import { drainOnSignals } from '../shared/shutdown.js';
import { startProcess } from '../shared/startup.js';
import { startWorker } from './runner.js';

/**
 * The worker process entry. SIGTERM/SIGINT: stop taking chunks, finish those in hand, exit 0;
 * after WORKER_DRAIN_SECONDS, or at the same signal again, exit 1 without them. One that cannot
 * start exits 1.
 */
await startProcess('keyfleet-worker', ['KEYFLEET_MASTER_KEY'], async (config, logger) => {
  // Before any thread starts, so that the crypto threads and libuv's pool inherit it.
  const lowered = lowerProcessPriority(config.workerPriority);
  const { nice, idle } = config.workerPriority;
  if (idle && !lowered.idle) logger.warn({ reason: lowered.idleRefused }, 'SCHED_IDLE not set (WORKER_SCHED=idle): the worker relies on its niceness');
  if (!lowered.nice) logger.warn({ nice }, 'could not lower the worker\'s niceness (some threads or all)');
  if (!lowered.nice && !lowered.idle) logger.warn('the worker competes with the API for CPU as an equal');
  logger.info({ nice: lowered.nice ? nice : 'unchanged', sched: lowered.idle ? 'idle' : 'normal' }, 'worker priority');
  const worker = await startWorker(config, logger);

  drainOnSignals({
    logger,
    close: () => worker.close(),
    // A chunk in hand that cannot be stored (Redis unreachable) would hold the drain for ever.
    deadlineMs: config.workerDrainSeconds * 1000,
    deadlineFields: { drainSeconds: config.workerDrainSeconds },
    messages: {
      draining: 'draining: finishing chunks in hand',
      stopped: 'worker stopped',
      deadline: 'drain not finished within WORKER_DRAIN_SECONDS (is Redis reachable?): exiting; the chunks in hand are retaken within about 2 × JOB_LOCK_MS',
      forced: 'second signal: exiting without finishing the chunks in hand (they are retaken within about 2 × JOB_LOCK_MS)',
    },
  });
});
