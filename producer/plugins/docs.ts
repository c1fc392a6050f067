import swagger from '@fastify/swagger';
import swaggerUi from '@fastify/swagger-ui';
import type { FastifyInstance } from 'fastify';
import fp from 'fastify-plugin';
import { jsonSchemaTransform, jsonSchemaTransformObject } from 'fastify-type-provider-zod';

export const DOCS_PATH = '/docs';

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
    transform: (input) => (input.url.startsWith('/admin') ? { schema: { ...input.schema, hide: true }, url: input.url } : jsonSchemaTransform(input)),
    transformObject: (input) => typedNullables(jsonSchemaTransformObject(input)),
  });
  await app.register(swaggerUi, { routePrefix: DOCS_PATH });
});

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
