import { pino } from 'pino';
import { ConfigError, loadConfig, shownRedisUrl, type Config, type RequiredSetting } from './config.js';
import { resolveKernel } from './crypto/kernel.js';
import { nativeKernelUnavailable } from './crypto/native-kernel.js';
import { createLogger, loggerOptions, type Logger } from './logger.js';
import { projectVersion } from './project-root.js';

/** The level before the configuration is read (LOG_LEVEL's default). */
const UNCONFIGURED_LEVEL = 'info';

/**
 * Writes one fatal line, `could not start`, and exits 1. Synchronously: the process logger's
 * stdout writes are asynchronous (pino's default), and process.exit() does not wait for one in
 * flight. Exiting rather than closing: a start that failed half-way may leave Redis connections
 * and a server open, and closing those could wait on an unreachable Redis.
 */
function exitNotStarted(name: string, level: string, err: unknown): never {
  const logger = pino(loggerOptions({ name, level }), pino.destination({ dest: 1, sync: true }));
  logger.fatal({ err }, 'could not start');
  process.exit(1);
}

/**
 * Reads the configuration (`required`: the settings the process cannot run without) and runs `start`, the start-up of a process (the API, a worker). A
 * failure — a bad setting, a port taken, a kernel asked for and not built — is one fatal JSON
 * line on stdout like the process's every other line, which log collectors parse, instead of
 * Node's stack trace on stderr; then exit 1. Before the configuration is read it is logged at
 * LOG_LEVEL's default, after it at LOG_LEVEL (`silent` silences it too).
 */
export async function startProcess(name: string, required: readonly RequiredSetting[], start: (config: Config, logger: Logger) => Promise<void>): Promise<void> {
  let level: string = UNCONFIGURED_LEVEL;
  try {
    const config = loadConfig(process.env, required);
    level = config.logLevel;
    await start(config, createLogger({ level, name }));
  } catch (err) {
    exitNotStarted(name, level, err);
  }
}

/**
 * A server that could not listen, as the setting to change: a ConfigError, whose fatal line
 * shows no stack (neither its own nor the system error's says more than the message), carrying
 * the system error's code, syscall, address and port. `whenInUse` says what to do about a port
 * another process holds.
 */
export function cannotListen(setting: string, host: string, port: number, err: unknown, whenInUse: string): ConfigError {
  const cause = err as NodeJS.ErrnoException;
  const where = `port ${port} on ${host}`;
  const refused = new ConfigError(cause.code === 'EADDRINUSE' ? `${setting}: ${where} is in use: ${whenInUse}` : `${setting}: cannot listen on ${where} (HOST): ${cause.message}`);
  const { code, errno, syscall } = cause;
  return Object.assign(refused, { code, errno, syscall, address: host, port });
}

/**
 * What the API's and every worker's start line say first: the version, the Redis (without its
 * credentials) and the crypto kernel, with why the native one is not in use where it is not.
 */
export function startFacts(config: Config): Record<string, unknown> {
  return {
    version: projectVersion(),
    redis: shownRedisUrl(config.redisUrl),
    ...(config.redisCluster ? { redisCluster: true } : {}),
    kernel: resolveKernel(config.kernel),
    ...(nativeKernelUnavailable ? { nativeUnavailable: nativeKernelUnavailable } : {}),
  };
}
