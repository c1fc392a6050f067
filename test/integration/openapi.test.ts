import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import { buildApp } from '../../producer/app.js';
import { generateOpenApi } from '../../scripts/openapi.js';
import { configFrom, testEnv } from '../helpers/env.js';

const committed = readFileSync(resolve(import.meta.dirname, '..', '..', 'openapi.json'), 'utf8');

describe('OpenAPI', () => {
  it('the committed openapi.json is what the routes generate (run `npm run openapi` after changing a route)', async () => {
    expect(await generateOpenApi()).toBe(committed);
  });

  it('gives every nullable schema a type, as OpenAPI 3.0 ignores nullable without one', () => {
    const untyped: string[] = [];
    const visit = (node: unknown, path: string): void => {
      if (node === null || typeof node !== 'object') return;
      const schema = node as Record<string, unknown>;
      if (schema['nullable'] === true && schema['type'] === undefined) untyped.push(path);
      for (const [key, value] of Object.entries(schema)) visit(value, `${path}/${key}`);
    };
    const doc = JSON.parse(committed);
    visit(doc, '');
    expect(untyped).toEqual([]);
    // The sync routes take null in place of an item (it fails alone): the document still says so.
    const item = doc.paths['/v1/encrypt/{key}'].post.requestBody.content['application/json'].schema.properties.items.items;
    expect(item.anyOf).toContainEqual({ type: 'string', nullable: true, enum: [null] });
  });

  it('serves the same document at /docs/json and Swagger UI at /docs, without a token', async () => {
    const { env } = testEnv();
    const app = await buildApp({ config: configFrom(env) });
    try {
      const json = await app.inject({ method: 'GET', url: '/docs/json' });
      expect(json.statusCode).toBe(200);
      const doc = json.json();
      expect(doc).toEqual(JSON.parse(committed));
      expect(doc.openapi).toMatch(/^3\./);
      expect(Object.keys(doc.paths)).toEqual(expect.arrayContaining(['/v1/encrypt/{key}', '/v1/batches', '/v1/batches/{id}/results', '/v1/keys/{name}/rotate']));
      expect(Object.keys(doc.paths).some((p: string) => p.startsWith('/admin'))).toBe(false);
      const ui = await app.inject({ method: 'GET', url: '/docs/' });
      expect(ui.statusCode).toBe(200);
      expect(ui.headers['content-type']).toMatch(/text\/html/);
    } finally {
      await app.close();
    }
  });
});
