import type { FastifyBaseLogger, FastifyServerOptions } from 'fastify';

type Level = 'fatal' | 'error' | 'warn' | 'info' | 'debug' | 'trace';
type Write = (...args: unknown[]) => void;
type PinoLike = FastifyBaseLogger & { isLevelEnabled?(level: string): boolean };

/**
 * A request's logger that becomes a pino child (the request id bound) only when it writes a
 * line at an enabled level. Fastify makes one logger per request, and pino's child() formats
 * and redacts its bindings each time: ~4 KB of garbage per request (allocation profile of the
 * sync path), for a logger most requests never write to.
 */
class LazyRequestLogger {
  readonly #parent: FastifyBaseLogger;
  readonly #bindings: Record<string, unknown>;
  #real: FastifyBaseLogger | undefined;

  constructor(parent: FastifyBaseLogger, bindings: Record<string, unknown>) {
    this.#parent = parent;
    this.#bindings = bindings;
  }

  get #logger(): FastifyBaseLogger {
    return (this.#real ??= this.#parent.child(this.#bindings));
  }

  get level(): string {
    return (this.#real ?? this.#parent).level;
  }

  set level(level: string) {
    this.#logger.level = level;
  }

  #write(level: Level, args: unknown[]): void {
    if (!this.isLevelEnabled(level)) return;
    (this.#logger[level] as Write)(...args);
  }

  fatal(...args: unknown[]): void {
    this.#write('fatal', args);
  }
  error(...args: unknown[]): void {
    this.#write('error', args);
  }
  warn(...args: unknown[]): void {
    this.#write('warn', args);
  }
  info(...args: unknown[]): void {
    this.#write('info', args);
  }
  debug(...args: unknown[]): void {
    this.#write('debug', args);
  }
  trace(...args: unknown[]): void {
    this.#write('trace', args);
  }
  silent(): void {}

  isLevelEnabled(level: string): boolean {
    return ((this.#real ?? this.#parent) as PinoLike).isLevelEnabled?.(level) ?? true;
  }

  child(bindings: Record<string, unknown>, options?: Record<string, unknown>): FastifyBaseLogger {
    return this.#logger.child(bindings, options);
  }
}

/** Fastify's childLoggerFactory: lazy request loggers, except for routes with their own log level. */
export const lazyRequestLoggers: NonNullable<FastifyServerOptions['childLoggerFactory']> = (logger, bindings, options) =>
  options.level ? logger.child(bindings, options) : (new LazyRequestLogger(logger, bindings) as unknown as FastifyBaseLogger);
