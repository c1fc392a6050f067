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
    transformObject: jsonSchemaTransformObject,
  });
  await app.register(swaggerUi, { routePrefix: DOCS_PATH });
});
