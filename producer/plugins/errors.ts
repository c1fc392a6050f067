import type { IncomingHttpHeaders } from 'node:http';
import type { FastifyError, FastifyInstance, FastifyRequest } from 'fastify';
import fp from 'fastify-plugin';
import { hasZodFastifySchemaValidationErrors } from 'fastify-type-provider-zod';
import { KeyfleetError, UPLOAD_MEDIA_TYPES, type ErrorCode } from '../../shared/errors.js';
import type { Logger } from '../../shared/logger.js';
import { ConnectionErrorLog } from '../../shared/redis.js';
import { closeAfterAnswer } from '../lingering-close.js';
import type { RouteMethods } from '../route-methods.js';

/** Fastify's own client errors, mapped onto the catalogue. */
const FASTIFY_CODES: Record<string, ErrorCode> = {
  FST_ERR_CTP_BODY_TOO_LARGE: 'KF_PAYLOAD_TOO_LARGE',
  FST_ERR_CTP_INVALID_MEDIA_TYPE: 'KF_UNSUPPORTED_MEDIA_TYPE',
  FST_ERR_CTP_EMPTY_JSON_BODY: 'KF_INVALID_JSON',
  FST_ERR_CTP_INVALID_CONTENT_LENGTH: 'KF_BAD_REQUEST',
};

// ioredis gives up on a command with MaxRetriesPerRequestError while it reconnects, and with
// "Command timed out" when a connected Redis does not answer (commandTimeout); the others are
// the socket's own failures.
const isRedisDown = (err: Error): boolean =>
  err.name === 'MaxRetriesPerRequestError' || /ECONNREFUSED|ECONNRESET|Connection is closed|max retries per request|Stream isn't writeable|ETIMEDOUT|Command timed out/i.test(err.message);

// A Redis at its maxmemory with noeviction (as keyfleet's Redis must run: an evicted chunk is a
// lost chunk) refuses writes with an OOM error until memory is freed (results expire or are
// deleted, workers catch up) or raised.
const isRedisFull = (err: Error): boolean => err.name === 'ReplyError' && err.message.startsWith('OOM ');

export interface ErrorsOptions {
  /** The methods each route path takes: a known path asked with another method is a 405. */
  readonly routeMethods: RouteMethods;
  /**
   * While Redis is unreachable every request fails alike: its error is logged here, once per
   * message per interval (each request is still counted in the request metrics by status).
   */
  readonly connectionErrors: ConnectionErrorLog;
}

/**
 * Whether a request has a body (RFC 9112 §6.3: only one framed by Transfer-Encoding or a
 * Content-Length). One without is not complete yet while a hook that answers at once runs, in
 * the same turn as its headers; closing its connection would drop a request pipelined behind it.
 */
const hasBody = (headers: IncomingHttpHeaders): boolean =>
  headers['transfer-encoding'] !== undefined || (headers['content-length'] !== undefined && headers['content-length'] !== '0');

/** Turns every error into `{"error": {"code", "message"}}` with a catalogue status; 5xx never carry detail. */
export const errorsPlugin = fp(async (app: FastifyInstance, { connectionErrors, routeMethods }: ErrorsOptions) => {
  const redisDown = (request: FastifyRequest, cause: Error): void =>
    connectionErrors.report('request', cause, 'request failed: redis unavailable', { reqId: request.id, code: 'KF_REDIS_UNAVAILABLE' });
  // Every write fails alike while Redis is full: logged as the outage is, once per interval.
  const redisFull = (request: FastifyRequest, cause: Error): void =>
    connectionErrors.report('request', cause, 'request failed: redis full (maxmemory)', { reqId: request.id, code: 'KF_REDIS_FULL' });
  // Refusals under load come many at a time, and a client can bring them on (bodies sent slowly):
  // one line per message (the API's bound, or a tenant's share) per interval, with the tenant of
  // the first, and how many were held back. The request metrics count every one by status.
  const refusals = new ConnectionErrorLog(app.log as Logger); // the pino logger buildApp gave fastify
  const busy = (request: FastifyRequest, cause: Error): void =>
    refusals.report('request', cause, 'request refused: request bodies held at once', { reqId: request.id, code: 'KF_BUSY', ...(request.principal ? { tenant: request.principal.tenant } : {}) });

  app.setErrorHandler((err: FastifyError, request, reply) => {
    let error: KeyfleetError;
    if (err instanceof KeyfleetError) {
      error = err;
      const cause = err.cause instanceof Error ? err.cause : err;
      if (error.code === 'KF_REDIS_UNAVAILABLE') redisDown(request, cause);
      else if (error.code === 'KF_BUSY') busy(request, cause);
      else if (error.status >= 500) request.log.error({ code: error.code, err: { message: cause.message } }, 'request failed');
    } else if (hasZodFastifySchemaValidationErrors(err)) {
      const where = err.validationContext ?? 'request';
      const detail = err.validation
        .slice(0, 5)
        .map((v) => `${[where, ...v.instancePath.split('/').filter(Boolean)].join('.')}: ${v.message}`)
        .join('; ');
      error = new KeyfleetError('KF_VALIDATION', detail);
    } else if (err.code === 'FST_ERR_CTP_INVALID_MEDIA_TYPE' && request.method === 'POST' && request.routeOptions.url === '/v1/batches') {
      error = new KeyfleetError('KF_UNSUPPORTED_MEDIA_TYPE', UPLOAD_MEDIA_TYPES);
    } else if (err.code && FASTIFY_CODES[err.code]) {
      error = new KeyfleetError(FASTIFY_CODES[err.code]!);
    } else if (err instanceof SyntaxError || err.code === 'FST_ERR_CTP_INVALID_JSON_BODY') {
      error = new KeyfleetError('KF_INVALID_JSON');
    } else if (typeof err.statusCode === 'number' && err.statusCode >= 400 && err.statusCode < 500) {
      error = new KeyfleetError('KF_BAD_REQUEST');
    } else if (isRedisDown(err)) {
      redisDown(request, err);
      error = new KeyfleetError('KF_REDIS_UNAVAILABLE');
    } else if (isRedisFull(err)) {
      redisFull(request, err);
      error = new KeyfleetError('KF_REDIS_FULL');
    } else {
      request.log.error({ err }, 'unhandled error');
      error = new KeyfleetError('KF_INTERNAL');
    }
    if (error.retryAfterSeconds !== undefined) reply.header('retry-after', String(error.retryAfterSeconds));
    // Answered before its body was read to the end (an upload that failed early, a body that went
    // quiet or over the limit): nobody reads the rest, so the connection closes after the answer,
    // in stages, so that a client still sending reads the answer before the close.
    // Kept open, it stayed with the unread bytes in its buffers, and held up the API's shutdown.
    if (!request.raw.complete && hasBody(request.raw.headers)) {
      reply.header('connection', 'close');
      closeAfterAnswer(request.raw);
    }
    return reply.status(error.status).send({ error: error.toBody() });
  });

  app.setNotFoundHandler((request, reply) => {
    const query = request.url.indexOf('?');
    const allowed = routeMethods.allowed(query === -1 ? request.url : request.url.slice(0, query));
    // RFC 9110: a 405 names the methods the path does take.
    if (allowed.length > 0) reply.header('allow', allowed.join(', '));
    const error = new KeyfleetError(allowed.length > 0 ? 'KF_METHOD_NOT_ALLOWED' : 'KF_NOT_FOUND');
    return reply.status(error.status).send({ error: error.toBody() });
  });
});
