import { loadConfig } from '../shared/config.js';
import { createLogger } from '../shared/logger.js';
import { buildApp } from './app.js';

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
    app.close().then(
      () => process.exit(0),
      (err: unknown) => {
        logger.error({ err }, 'shutdown failed');
        process.exit(1);
      },
    );
  });
}
