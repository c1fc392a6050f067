import swagger from '@fastify/swagger';
import swaggerUi from '@fastify/swagger-ui';
import type { FastifyInstance, FastifySchema } from 'fastify';
import fp from 'fastify-plugin';
import { jsonSchemaTransform, jsonSchemaTransformObject } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { CATALOGUE, type ErrorCode } from '../../shared/errors.js';
import { errorResponse } from '../../shared/schemas.js';

export const DOCS_PATH = '/docs';

declare module 'fastify' {
  interface FastifySchema {
    /** What the document says beyond the validating schema; fastify never reads it (RouteDocs). */
    docs?: RouteDocs;
  }
}

/** A documented answer: a zod schema of its JSON, or its content by media type. */
export type DocumentedAnswer = z.ZodType | { readonly description: string; readonly content: { readonly [mediaType: string]: { readonly schema: z.ZodType } } };

/**
 * Documentation a route's schema cannot carry without fastify validating or serializing by it:
 * the transform below reads it, and only the document changes.
 */
export interface RouteDocs {
  /** The route takes Idempotency-Key (producer/idempotency.ts): the header, and Idempotent-Replayed on its answers. */
  readonly idempotent?: boolean;
  /**
   * The body as documented: a schema stricter than the one that validates (items that fail alone
   * instead of the request), or by media type, the body of a route that reads its own (fastify
   * validates `schema.body` whenever there is one).
   */
  readonly body?: z.ZodType | { readonly [mediaType: string]: z.ZodType };
  /** Answers beyond the schema's `response`, by status. */
  readonly responses?: { readonly [status: string]: DocumentedAnswer };
}

/**
 * Error answers, `{"error": {"code", "message"}}`, by the status the catalogue gives each code,
 * described by the codes (a Markdown list of more than one). A status listed here stands for all
 * its codes on the route (it takes the place of `4xx` there).
 */
export function errorAnswers(...codes: ErrorCode[]): Record<string, DocumentedAnswer> {
  const byStatus = new Map<number, string[]>();
  for (const code of codes) byStatus.set(CATALOGUE[code].status, [...(byStatus.get(CATALOGUE[code].status) ?? []), `${code}: ${CATALOGUE[code].message}`]);
  const described = (lines: string[]): string => (lines.length === 1 ? lines[0]! : lines.map((line) => `- ${line}`).join('\n'));
  return Object.fromEntries([...byStatus].map(([status, lines]) => [String(status), { description: described(lines), content: { 'application/json': { schema: errorResponse } } }]));
}

/** As producer/idempotency.ts checks it: 1-255 printable ASCII characters. */
const idempotencyHeader = z.object({
  'Idempotency-Key': z
    .string()
    .min(1)
    .max(255)
    .regex(/^[\x20-\x7e]{1,255}$/)
    .describe(
      'Makes a retry safe: the same key with the same request (method, path, query, body) gets the first answer again, marked Idempotent-Replayed, without the work being done twice. ' +
        'Keys are per tenant and kept for IDEMPOTENCY_TTL_SECONDS; a request that failed frees its key. The same key with another request is 409 KF_IDEMPOTENCY_MISMATCH; ' +
        'while the first still runs, 409 KF_IDEMPOTENCY_IN_PROGRESS with Retry-After. Anything but 1-255 printable ASCII characters is 400 KF_IDEMPOTENCY_KEY_INVALID.',
    )
    .optional(),
});
const RETRY_AFTER = { type: 'integer', description: 'Seconds to wait before sending the request again' };
const REPLAYED = { type: 'string', enum: ['true'], description: 'The first answer to this Idempotency-Key, given again: the work was not done a second time' };
/**
 * Marks an operation whose body may be left out: @fastify/swagger writes `required: true` for
 * every body schema, and transformObject sets it right (and drops the mark).
 */
const OPTIONAL_BODY = 'x-keyfleet-optional-body';

/**
 * OpenAPI 3 generated from the routes' zod schemas (the same ones that validate requests),
 * served as JSON at /docs/json and as Swagger UI at /docs. Both are public: they describe the
 * API, nothing of its data. Bull Board's routes are left out.
 */
export const docsPlugin = fp(async (app: FastifyInstance, { version }: { version: string }) => {
  await app.register(swagger, {
    openapi: {
      openapi: '3.0.3',
      info: {
        title: 'keyfleet',
        description: 'Bulk encryption of small secrets under named, versioned keys that never leave the service.',
        version,
      },
      components: {
        securitySchemes: {
          bearer: { type: 'http', scheme: 'bearer', description: 'A token from KEYFLEET_TOKENS' },
        },
      },
      security: [{ bearer: [] }],
    },
    transform: (input) => (input.url.startsWith('/admin') ? { schema: { ...input.schema, hide: true }, url: input.url } : documented(input)),
    transformObject: (input) => typedNullables(optionalBodies(jsonSchemaTransformObject(input))),
  });
  await app.register(swaggerUi, { routePrefix: DOCS_PATH });
});

type TransformInput = Parameters<typeof jsonSchemaTransform>[0];

/**
 * A route's schema as documented: its `docs` and what holds for every route laid over the
 * validating schema, the zod parts converted as the rest (jsonSchemaTransform), then what has no
 * zod form added to the JSON. Every /v1 route may find the backing store down or full (503), and
 * one that takes a JSON body may find the API holding as many bodies as it may; a 429 or 503
 * always comes with Retry-After; a 204 has no content.
 */
function documented(input: TransformInput): { schema: FastifySchema; url: string } {
  if (!input.schema) return jsonSchemaTransform(input);
  const { docs, ...schema } = input.schema;
  const answers = {
    ...(input.url.startsWith('/v1/') ? errorAnswers(...(schema.body ? (['KF_BUSY'] as const) : []), 'KF_REDIS_UNAVAILABLE', 'KF_REDIS_FULL') : {}),
    ...(schema.response as Record<string, DocumentedAnswer> | undefined),
    ...docs?.responses,
  };
  const converted = jsonSchemaTransform({
    ...input,
    schema: {
      ...schema,
      ...(docs?.body instanceof z.ZodType ? { body: docs.body } : {}),
      ...(docs?.idempotent ? { headers: idempotencyHeader } : {}),
      ...(Object.keys(answers).length > 0 ? { response: answers } : {}),
    },
  });
  const result: Record<string, unknown> = { ...converted.schema };
  if (docs?.body && !(docs.body instanceof z.ZodType)) {
    // @fastify/swagger takes a body given by media type as it is (`content`), and requires it.
    const content = Object.entries(docs.body).map(([type, body]) => [type, { schema: z.toJSONSchema(body, { target: 'openapi-3.0', io: 'input' }) }]);
    result['body'] = { content: Object.fromEntries(content) };
  }
  if (schema.body instanceof z.ZodType && schema.body.safeParse(undefined).success) result[OPTIONAL_BODY] = true;
  const responses = result['response'] as Record<string, Record<string, unknown>> | undefined;
  for (const [status, answer] of Object.entries(responses ?? {})) {
    const headers = {
      ...(status === '429' || status === '503' ? { 'Retry-After': RETRY_AFTER } : {}),
      ...(docs?.idempotent && status.startsWith('2') ? { 'Idempotent-Replayed': REPLAYED } : {}),
    };
    // A null schema is what @fastify/swagger writes without content.
    const shown = status === '204' ? { type: 'null', description: answer['description'] } : answer;
    responses![status] = Object.keys(headers).length > 0 ? { ...shown, headers } : shown;
  }
  return { schema: result as FastifySchema, url: converted.url };
}

/** Sets `requestBody.required: false` where the transform marked the body optional. */
function optionalBodies<T>(document: T): T {
  const paths = (document as { paths?: Record<string, Record<string, Record<string, unknown>>> }).paths ?? {};
  for (const operation of Object.values(paths).flatMap((item) => Object.values(item))) {
    if (operation[OPTIONAL_BODY] !== true) continue;
    delete operation[OPTIONAL_BODY];
    (operation['requestBody'] as { required: boolean }).required = false;
  }
  return document;
}

/**
 * OpenAPI 3.0 reads `nullable` only beside a `type` (3.0.3, Schema Object). zod writes a union
 * with null as `anyOf` (or `oneOf`) with `nullable: true` and no type, which tools and generated
 * clients then read as not nullable; null becomes a member of the union of its own instead.
 */
function typedNullables<T>(document: T): T {
  const visit = (node: unknown): void => {
    if (Array.isArray(node)) return node.forEach(visit);
    if (node === null || typeof node !== 'object') return;
    const schema = node as Record<string, unknown>;
    Object.values(schema).forEach(visit);
    const members = schema['anyOf'] ?? schema['oneOf'];
    if (schema['nullable'] === true && schema['type'] === undefined && Array.isArray(members)) {
      delete schema['nullable'];
      members.push({ type: 'string', nullable: true, enum: [null] });
    }
  };
  visit(document);
  return document;
}
