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
  };
}

export function createLogger(settings: LoggerSettings): Logger {
  const options = loggerOptions(settings);
  return settings.destination ? pino(options, settings.destination) : pino(options);
}

export type { Logger };
