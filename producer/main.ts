import { drainOnSignals } from '../shared/shutdown.js';
import { cannotListen, startFacts, startProcess } from '../shared/startup.js';
import { buildApp } from './app.js';

/**
 * A drain not over by then is cut short (exit 1): requests in flight (a long upload or download)
 * have until then, and a close that waits on an unreachable Redis would otherwise wait for ever.
 * Within the grace period of deploy/k8s/api.yaml (40 s, of which its preStop sleep takes 5) and
 * the compose file's stop_grace_period (30 s).
 */
const SHUTDOWN_DEADLINE_MS = 25_000;

/** The API server entry: listens on HOST:PORT and drains on SIGTERM/SIGINT; one that cannot start exits 1. */
await startProcess('keyfleet-api', ['KEYFLEET_TOKENS', 'KEYFLEET_MASTER_KEY'], async (config, logger) => {
  const app = await buildApp({ config, logger });
  const address = await app.listen({ host: config.host, port: config.port }).catch((err: unknown) => {
    // listen() readies the app first: only the bind's own failure is about PORT.
    throw (err as NodeJS.ErrnoException).syscall === 'listen' ? cannotListen('PORT', config.host, config.port, err, 'another process listens there; set PORT to a free one') : err;
  });
  // What an operator asks first of a process: which version, which Redis (its password not
  // shown) and which keys in it, and the limits that shape its answers.
  logger.info({ ...startFacts(config), address, prefix: config.prefix, syncMaxItems: config.syncMaxItems, chunkItems: config.chunkItems }, 'api started');

  drainOnSignals({
    logger,
    close: () => app.close(),
    deadlineMs: SHUTDOWN_DEADLINE_MS,
    deadlineFields: { deadlineMs: SHUTDOWN_DEADLINE_MS },
    messages: {
      draining: 'shutting down',
      deadline: 'shutdown not finished in time: exiting',
      forced: 'second signal: exiting without finishing the requests in flight',
    },
  });
});
