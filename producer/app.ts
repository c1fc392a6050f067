import { isUtf8 } from 'node:buffer';
import { randomUUID } from 'node:crypto';
import Fastify, { LogController, type FastifyBaseLogger, type FastifyError, type FastifyInstance, type FastifyReply, type FastifyRequest } from 'fastify';
import { serializerCompiler, validatorCompiler } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { ConfigError, REQUIRED, type Config } from '../shared/config.js';
import { KeyfleetError } from '../shared/errors.js';
import { resolveKernel } from '../shared/crypto/kernel.js';
import { nativeKernel } from '../shared/crypto/native-kernel.js';
import { createLogger, type Logger } from '../shared/logger.js';
import { projectVersion } from '../shared/project-root.js';
import { matchDigest, TokenVerifier } from '../shared/tokens.js';
import { BodyBudget } from './body-budget.js';
import { refuseCompressedBodies } from './body-coding.js';
import { watchBodies } from './body-timeout.js';
import { clientErrorHandler, refuseWithoutHost } from './client-errors.js';
import { coalesceWrites } from './coalesced-writes.js';
import { refuseOnClosingConnection } from './lingering-close.js';
import { lazyRequestLoggers } from './request-logger.js';
import { adminRoutes } from './plugins/admin.js';
import { authPlugin } from './plugins/auth.js';
import { docsPlugin } from './plugins/docs.js';
import { errorsPlugin } from './plugins/errors.js';
import { metricsPlugin } from './plugins/metrics.js';
import { rateLimitPlugin } from './plugins/rate-limit.js';
import { batchRoutes } from './routes/batches.js';
import { cryptoRoutes } from './routes/crypto.js';
import { healthRoutes } from './routes/health.js';
import { keyRoutes } from './routes/keys.js';
import { RouteMethods } from './route-methods.js';
import { createApiServices, type ApiServices } from './services.js';

// A field or parameter left out reads "required" (of an enum: with its values), where zod's
// default reads "Invalid input: expected string, received undefined"; schemas' own messages
// come first. Set here, in the API, not in shared/schemas.ts: zod's configuration is global to
// the process, and the client library, which imports the schemas, must not change an app's.
z.config({
  customError: (issue) => {
    if (issue.input !== undefined) return undefined;
    if (issue.code === 'invalid_type') return 'required';
    if (issue.code === 'invalid_value') return `required: one of ${issue.values.map((v) => JSON.stringify(v)).join(', ')}`;
    return undefined;
  },
});

declare module 'fastify' {
  interface FastifyInstance {
    services: ApiServices;
    keyfleet: Config;
  }
}

export interface AppOptions {
  readonly config: Config;
  /** Defaults to a pino logger at LOG_LEVEL on stdout; tests pass one writing to a stream they read. */
  readonly logger?: Logger;
}

const REQUEST_ID = /^[A-Za-z0-9._-]{1,64}$/;
// Key names may be 128 characters; longer segments are refused as 414 without a lookup.
const MAX_PARAM_LENGTH = 256;

function frameworkErrors(error: FastifyError, _request: FastifyRequest, reply: FastifyReply): void {
  const kf = new KeyfleetError(error.code === 'FST_ERR_MAX_PARAM_LENGTH' ? 'KF_URI_TOO_LONG' : 'KF_BAD_REQUEST');
  void reply.status(kf.status).send({ error: kf.toBody() });
}

function refuseQuery(request: FastifyRequest, _reply: FastifyReply, done: (err?: Error) => void): void {
  const unknown = Object.keys(request.query as Record<string, unknown>);
  if (unknown.length === 0) return done();
  done(new KeyfleetError('KF_VALIDATION', `querystring: unrecognized parameter(s) ${unknown.slice(0, 5).map((k) => JSON.stringify(k.slice(0, 64))).join(', ')}`));
}

const MALFORMED_ESCAPE = 'holds a malformed percent-escape (expected %XX escapes of UTF-8 bytes; a literal % is %25)';

const decodes = (text: string): boolean => {
  try {
    decodeURIComponent(text);
    return true;
  } catch {
    return false;
  }
};

/**
 * fastify's query parser keeps a part it cannot decode (`context=%FF`, `context=100%`) as its
 * literal text, so a route would take a value the caller never sent: as a batch's context, bound
 * into every ciphertext. Such a query is a 400 naming the parameter, never its value (a context
 * is tenant data). Only a URL with a `%` after its `?` is read again.
 */
function refuseMalformedQuery(request: FastifyRequest, _reply: FastifyReply, done: (err?: Error) => void): void {
  const url = request.url;
  const at = url.indexOf('?');
  if (at === -1 || url.indexOf('%', at) === -1) return done();
  for (const part of url.slice(at + 1).split('&')) {
    const equals = part.indexOf('=');
    const name = equals === -1 ? part : part.slice(0, equals);
    if (!decodes(name)) return done(new KeyfleetError('KF_VALIDATION', `querystring: a parameter name ${MALFORMED_ESCAPE}`));
    if (equals !== -1 && !decodes(part.slice(equals + 1))) {
      const shown = JSON.stringify(decodeURIComponent(name.replaceAll('+', ' ')).slice(0, 64));
      return done(new KeyfleetError('KF_VALIDATION', `querystring: parameter ${shown} ${MALFORMED_ESCAPE}`));
    }
  }
  return done();
}

/** True for a schema that refuses keys it does not name: a strict object, optional or nullable or not. */
function refusesUnknownKeys(schema: unknown): boolean {
  let inner = schema;
  while (inner instanceof z.ZodOptional || inner instanceof z.ZodNullable) inner = inner.unwrap();
  return inner instanceof z.ZodObject && inner.def.catchall instanceof z.ZodNever;
}

/** Builds the API without listening. Everything it opens is closed by `app.close()`. */
export async function buildApp({ config, logger }: AppOptions): Promise<FastifyInstance> {
  if (config.tokens.length === 0) {
    throw new ConfigError(`invalid configuration:\n  KEYFLEET_TOKENS: ${REQUIRED.KEYFLEET_TOKENS}`);
  }
  const kernel = resolveKernel(config.kernel); // fails fast when `native` was asked and is not built
  const verifier = new TokenVerifier(config.tokens, kernel === 'native' ? nativeKernel!.tokenIndex : matchDigest);
  const app = Fastify({
    loggerInstance: (logger ?? createLogger({ level: config.logLevel, name: 'keyfleet-api' })) as FastifyBaseLogger,
    childLoggerFactory: lazyRequestLoggers,
    // Two lines per request only when asked for (LOG_REQUESTS): /metrics times every request.
    logController: new LogController({ disableRequestLogging: !config.logRequests }),
    bodyLimit: config.maxBodyBytes,
    clientErrorHandler,
    http: { requireHostHeader: false },
    // Errors the router raises before any route runs (a malformed URL, an overlong path
    // parameter) get the same envelope as every other error.
    frameworkErrors,
    routerOptions: { maxParamLength: MAX_PARAM_LENGTH },
    // A caller's request id is kept when it is sane, so one id follows a request into its batch.
    genReqId: (req) => {
      const given = req.headers['x-request-id'];
      return typeof given === 'string' && REQUEST_ID.test(given) ? given : randomUUID();
    },
  });
  app.setValidatorCompiler(validatorCompiler);
  app.setSerializerCompiler(serializerCompiler);
  // The API takes JSON bodies (and, for uploads, NDJSON: routes/batches.ts); text/plain is a 415.
  app.removeContentTypeParser('text/plain');
  // JSON text is UTF-8 (RFC 8259, 8.1). fastify decodes other bytes as U+FFFD, so an item sent
  // with a stray byte was encrypted as other text than was sent. Before the body is parsed no
  // byte can be told to belong to an item: such a body is refused as a whole. (Uploads read
  // their own bodies and fail only the items with such bytes.)
  //
  // fastify's own parser, without its scans for `__proto__` and `constructor` keys. JSON.parse
  // makes such a key an own property, never a prototype; the harm would be in code that merged
  // the parsed object into another. Here every JSON body is read by a strict schema (checked as
  // each route is added, below), which refuses a key it does not name (a 400 naming it) and
  // builds new objects of the keys it names; an item object with any other key fails alone as
  // KF_INVALID_ITEM. The two scans of every body were 1.4% of the API's CPU time under the
  // 10-item encrypt (a profile, bench/NOTES.md). Bull Board parses its own bodies (admin.ts).
  const parseJson = app.getDefaultJsonParser('ignore', 'ignore');
  app.removeContentTypeParser('application/json');
  app.addContentTypeParser('application/json', { parseAs: 'buffer' }, (request, body: Buffer, done) => {
    // An empty body is no body, whatever its header says: a client that sends `content-type:
    // application/json` on every request is not refused a rotate or a DELETE for it (fastify's
    // parser answers 400). A route that needs a body refuses its absence (KF_VALIDATION).
    if (body.length === 0) done(null, undefined);
    else if (isUtf8(body)) parseJson(request, body.toString('utf8'), done);
    else done(new KeyfleetError('KF_INVALID_JSON', 'the body is not valid UTF-8, as JSON text must be'), undefined);
  });
  app.addHook('onRequest', refuseOnClosingConnection);
  app.addHook('onRequest', refuseWithoutHost);
  coalesceWrites(app);
  app.addHook('preParsing', refuseCompressedBodies);
  app.addHook('preParsing', watchBodies(config.uploadIdleSeconds, new BodyBudget(config.maxBodyBytesInFlight, config.maxTenantBodyBytesInFlight, config.maxBodyBytes)));
  // A query parameter an API route does not take is a 400, as an unknown body field is: a
  // mistyped one must not be ignored. Routes that take parameters refuse unknown ones in their
  // schema, and values they could not decode here; the others refuse any parameter. Each check
  // is added when a route is registered (not a hook on every request).
  const routeMethods = new RouteMethods({ maxParamLength: MAX_PARAM_LENGTH });
  app.addHook('onRoute', (route) => {
    routeMethods.add(route.method, route.url);
    if (route.schema?.body !== undefined && !refusesUnknownKeys(route.schema.body)) {
      throw new Error(`${route.method} ${route.url}: a JSON body's schema must be a strict object (the JSON parser leaves __proto__ keys to it)`);
    }
    if (!route.url.startsWith('/v1/')) return;
    route.preValidation = [...[route.preValidation ?? []].flat(), route.schema?.querystring ? refuseMalformedQuery : refuseQuery];
  });

  const services = createApiServices(config, app.log as Logger);
  app.decorate('services', services);
  app.decorate('keyfleet', config);
  // Keys made by an API from before the key index are listed once a start has indexed them; in
  // the background, as the scan reads every key's name.
  const indexing = new AbortController();
  let indexed: Promise<void> = Promise.resolve();
  app.addHook('onListen', async () => {
    indexed = services.keyStore.indexAll(indexing.signal).then(
      (counts) => app.log.info(counts, 'key index checked'),
      (err: Error) => app.log.warn({ err: { message: err.message } }, 'key index not checked: the next start tries again'),
    );
  });
  app.addHook('preClose', async () => {
    indexing.abort();
    await Promise.all([indexed, services.events.shutdown()]);
  });
  app.addHook('onClose', async () => services.close());

  await app.register(errorsPlugin, { connectionErrors: services.connectionErrors, routeMethods });
  await app.register(authPlugin, { verifier });
  await app.register(metricsPlugin);
  await app.register(rateLimitPlugin, { redis: services.redis, prefix: config.prefix, perSecond: config.syncRateLimit });
  await app.register(docsPlugin, { version: projectVersion() });
  await app.register(healthRoutes);
  await app.register(keyRoutes);
  await app.register(cryptoRoutes);
  await app.register(batchRoutes);
  await app.register(adminRoutes);
  return app;
}
