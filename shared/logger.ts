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

export function loggerOptions(settings: Pick<LoggerSettings, 'level' | 'name'>): LoggerOptions {
  return {
    name: settings.name,
    level: settings.level,
    redact: { paths: REDACT_PATHS, censor: '[redacted]' },
    // Fastify's request line (LOG_REQUESTS), with the query censored (loggedUrl).
    serializers: {
      req: (req: RequestLike) => ({ method: req.method, url: req.url === undefined ? undefined : loggedUrl(req.url), host: req.host, remoteAddress: req.ip, remotePort: req.socket?.remotePort }),
    },
  };
}

export function createLogger(settings: LoggerSettings): Logger {
  const options = loggerOptions(settings);
  return settings.destination ? pino(options, settings.destination) : pino(options);
}

export type { Logger };
