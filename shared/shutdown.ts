import type { Logger } from './logger.js';

export interface DrainOptions {
  readonly logger: Logger;
  /** Closes everything; the process exits 0 when it resolves, 1 when it rejects. */
  readonly close: () => Promise<void>;
  /** After this long the process exits 1 without waiting for `close`. */
  readonly deadlineMs: number;
  /** What is logged: as the drain starts, when it is over, at the deadline (with `deadlineFields`), and at the same signal again. */
  readonly messages: { readonly draining: string; readonly stopped?: string; readonly deadline: string; readonly forced: string };
  readonly deadlineFields?: Record<string, unknown>;
}

/**
 * SIGTERM and SIGINT start one drain. Another signal meanwhile is ignored, but the same one
 * again forces the exit (1): Ctrl-C under `npm start` sends SIGINT to the process and to the dev
 * runner, which then sends SIGTERM, and that one should not cut the drain short; a second
 * Ctrl-C should. A drain that waits on an unreachable Redis would otherwise wait for ever.
 */
export function drainOnSignals({ logger, close, deadlineMs, messages, deadlineFields = {} }: DrainOptions): void {
  let closing: NodeJS.Signals | undefined;
  for (const signal of ['SIGTERM', 'SIGINT'] as const) {
    process.on(signal, () => {
      if (closing === signal) {
        logger.warn({ signal }, messages.forced);
        process.exit(1);
      }
      if (closing) return;
      closing = signal;
      logger.info({ signal }, messages.draining);
      setTimeout(() => {
        logger.error(deadlineFields, messages.deadline);
        process.exit(1);
      }, deadlineMs).unref();
      close().then(
        () => {
          if (messages.stopped) logger.info(messages.stopped);
          process.exit(0);
        },
        (err: unknown) => {
          logger.error({ err }, 'shutdown failed');
          process.exit(1);
        },
      );
    });
  }
}
