import { pino, type DestinationStream, type Logger, type LoggerOptions } from 'pino';

/**
 * Paths that could hold a secret anywhere a log line is built from a request, a job or an error.
 * Censoring is belt and braces: code never logs items, tokens or key material in the first place.
 */
export const REDACT_PATHS = [
  'req.headers.authorization',
  'req.headers.cookie',
  'headers.authorization',
  'authorization',
  'token',
  'items',
  'body.items',
  'plaintext',
  'ciphertext',
  'material',
  'masterKey',
  '*.token',
  '*.items',
  '*.plaintext',
  '*.ciphertext',
  '*.material',
];

/**
 * Query parameters whose values a request line shows (LOG_REQUESTS). Any other value is
 * censored: a callbackUrl may carry its receiver's credentials, a context names whom an item
 * belongs to, and an unknown parameter may be anything.
 */
const SHOWN_QUERY = new Set(['op', 'key', 'targetKey', 'encoding', 'mode', 'from']);

/** A URL for a log line: the path as it is, the query with only SHOWN_QUERY values. */
function loggedUrl(url: string): string {
  const query = url.indexOf('?');
  if (query === -1) return url;
  const params = [...new URLSearchParams(url.slice(query + 1))].map(([name, value]) =>
    `${encodeURIComponent(name)}=${SHOWN_QUERY.has(name) ? encodeURIComponent(value) : '[redacted]'}`);
  return `${url.slice(0, query)}?${params.join('&')}`;
}

interface RequestLike {
  readonly method?: string;
  readonly url?: string;
  readonly host?: string;
  readonly ip?: string;
  readonly socket?: { readonly remotePort?: number };
}

export interface LoggerSettings {
  readonly level: string;
  readonly name: string;
  readonly destination?: DestinationStream;
}

/** Fields of Node's system errors that say where a call failed, and nothing secret. */
const SYSTEM_ERROR_FIELDS = ['code', 'errno', 'syscall', 'address', 'port', 'status', 'statusCode'] as const;

/** Causes and aggregated errors are followed this deep. */
const MAX_ERROR_DEPTH = 3;

/** The name of the Redis command an ioredis error is about (never its arguments). */
export function commandName(err: Error): string | undefined {
  const name = (err as { command?: { name?: unknown } }).command?.name;
  return typeof name === 'string' ? name : undefined;
}

/**
 * What a log line shows of an error. pino's own serializer copies every enumerable property, and
 * an error may carry anything: ioredis's ReplyError the command's arguments (on a SET that a full
 * Redis refused, a chunk's sealed bytes: an 850 KB line), Node's URL errors the URL with its
 * password. So: type, message, stack, the system-error fields above, of a Redis command only its
 * name, and causes and related errors the same way. A ConfigError's message names every bad
 * variable (shared/config.ts); its stack adds nothing.
 */
export function errorForLog(err: unknown, depth = 0): unknown {
  if (!(err instanceof Error)) return err;
  const fields = err as unknown as Record<string, unknown>;
  const shown: Record<string, unknown> = { type: err.name, message: err.message };
  if (err.name !== 'ConfigError') shown['stack'] = err.stack;
  for (const field of SYSTEM_ERROR_FIELDS) {
    const value = fields[field];
    if (typeof value === 'string' || typeof value === 'number') shown[field] = value;
  }
  const command = commandName(err);
  if (command) shown['command'] = command;
  if (depth < MAX_ERROR_DEPTH) {
    if (err.cause !== undefined) shown['cause'] = errorForLog(err.cause, depth + 1);
    // ioredis's own causes: a cluster that found no node (the last node's error), and a
    // transaction Redis discarded (the errors of the commands that made it).
    if (fields['lastNodeError'] !== undefined) shown['lastNodeError'] = errorForLog(fields['lastNodeError'], depth + 1);
    const related = err instanceof AggregateError ? err.errors : fields['previousErrors'];
    if (Array.isArray(related)) shown[err instanceof AggregateError ? 'errors' : 'previousErrors'] = related.slice(0, 5).map((e: unknown) => errorForLog(e, depth + 1));
  }
  return shown;
}

export function loggerOptions(settings: Pick<LoggerSettings, 'level' | 'name'>): LoggerOptions {
  return {
    name: settings.name,
    level: settings.level,
    redact: { paths: REDACT_PATHS, censor: '[redacted]' },
    // Fastify's request line (LOG_REQUESTS), with the query censored (loggedUrl).
    serializers: {
      err: errorForLog,
      req: (req: RequestLike) => ({ method: req.method, url: req.url === undefined ? undefined : loggedUrl(req.url), host: req.host, remoteAddress: req.ip, remotePort: req.socket?.remotePort }),
    },
  };
}

export function createLogger(settings: LoggerSettings): Logger {
  const options = loggerOptions(settings);
  return settings.destination ? pino(options, settings.destination) : pino(options);
}

export type { Logger };
