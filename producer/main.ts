import { loadConfig } from '../shared/config.js';
import { createLogger } from '../shared/logger.js';
import { buildApp } from './app.js';

/**
 * A drain not over by then is cut short (exit 1): requests in flight (a long upload or download)
 * have until then, and a close that waits on an unreachable Redis would otherwise wait for ever.
 * Below the 30 s grace period of deploy/k8s/api.yaml.
 */
const SHUTDOWN_DEADLINE_MS = 25_000;

/** The API server entry: listens on HOST:PORT and drains on SIGTERM/SIGINT. */
const config = loadConfig();
const logger = createLogger({ level: config.logLevel, name: 'keyfleet-api' });
const app = await buildApp({ config, logger });
await app.listen({ host: config.host, port: config.port });

let closing = false;
for (const signal of ['SIGTERM', 'SIGINT'] as const) {
  process.once(signal, () => {
    if (closing) return;
    closing = true;
    logger.info({ signal }, 'shutting down');
    setTimeout(() => {
      logger.error({ deadlineMs: SHUTDOWN_DEADLINE_MS }, 'shutdown not finished in time: exiting');
      process.exit(1);
    }, SHUTDOWN_DEADLINE_MS).unref();
    app.close().then(
      () => process.exit(0),
      (err: unknown) => {
        logger.error({ err }, 'shutdown failed');
        process.exit(1);
      },
    );
  });
}
