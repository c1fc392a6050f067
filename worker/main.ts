import { loadConfig } from '../shared/config.js';
import { createLogger } from '../shared/logger.js';
import { lowerProcessPriority } from '../shared/priority.js';
import { startWorker } from './runner.js';

/** The worker process entry. SIGTERM/SIGINT: stop taking chunks, finish those in hand, exit 0. */
const config = loadConfig();
const logger = createLogger({ level: config.logLevel, name: 'keyfleet-worker' });
// Before any thread starts, so that the crypto threads and libuv's pool inherit it.
const lowered = lowerProcessPriority(config.workerPriority);
const { nice, idle } = config.workerPriority;
if (idle && !lowered.idle) logger.warn({ reason: lowered.idleRefused }, 'SCHED_IDLE not set (WORKER_SCHED=idle): the worker relies on its niceness');
if (!lowered.nice) logger.warn({ nice }, 'could not lower the worker\'s niceness (some threads or all)');
if (!lowered.nice && !lowered.idle) logger.warn('the worker competes with the API for CPU as an equal');
logger.info({ nice: lowered.nice ? nice : 'unchanged', sched: lowered.idle ? 'idle' : 'normal' }, 'worker priority');
const worker = await startWorker(config, logger);

let closing = false;
for (const signal of ['SIGTERM', 'SIGINT'] as const) {
  process.once(signal, () => {
    if (closing) return;
    closing = true;
    logger.info({ signal }, 'draining: finishing chunks in hand');
    worker.close().then(
      () => {
        logger.info('worker stopped');
        process.exit(0);
      },
      (err: unknown) => {
        logger.error({ err }, 'shutdown failed');
        process.exit(1);
      },
    );
  });
}
