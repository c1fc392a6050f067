import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { Ajv } from 'ajv';
import type { FastifyRequest } from 'fastify';
import { describe, expect, it } from 'vitest';
import { buildApp } from '../../producer/app.js';
import { idempotencyKeyOf } from '../../producer/idempotency.js';
import { generateOpenApi } from '../../scripts/openapi.js';
import { configFrom, testEnv } from '../helpers/env.js';

const committed = readFileSync(resolve(import.meta.dirname, '..', '..', 'openapi.json'), 'utf8');
const doc = JSON.parse(committed);

/** An operation of the document, read loosely (it is JSON). */
type Operation = Record<string, any>;
const operation = (method: string, path: string): Operation => doc.paths[path][method];
const operations = (): [string, string, Operation][] =>
  Object.entries(doc.paths as Record<string, Record<string, Operation>>).flatMap(([path, item]) => Object.entries(item).map(([method, op]): [string, string, Operation] => [method, path, op]));
/** The error codes an answer's description names. */
const codesOf = (answer: { description: string } | undefined): string[] => answer?.description.match(/KF_[A-Z0-9_]+/g) ?? [];
/** Whether the API takes `key` as an Idempotency-Key. */
const takesIdempotencyKey = (key: string): boolean => {
  try {
    idempotencyKeyOf({ headers: { 'idempotency-key': key } } as unknown as FastifyRequest);
    return true;
  } catch {
    return false;
  }
};

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
    visit(doc, '');
    expect(untyped).toEqual([]);
  });

  it('documents the items each sync route reads, not the laxer schema that validates them (a bad item fails alone)', () => {
    const ajv = new Ajv({ strict: false });
    for (const [op, own, wrong] of [['encrypt', 'plaintext', 'ciphertext'], ['decrypt', 'ciphertext', 'plaintext'], ['rewrap', 'ciphertext', 'plaintext']] as const) {
      const item = ajv.compile(operation('post', `/v1/${op}/{key}`).requestBody.content['application/json'].schema.properties.items.items);
      expect([item('kf:v1:…'), item({ [own]: 'x' }), item({ [own]: 'x', context: 'c' })]).toEqual([true, true, true]);
      // The service fails these alone as KF_INVALID_ITEM: the document does not offer them.
      expect([item(null), item(1), item({ [wrong]: 'x' }), item({ [own]: 'x', other: 1 })]).toEqual([false, false, false, false]);
    }
    // keyVersion is for encrypt only, targetKey for rewrap only (the others refuse them).
    const fields = (op: string): string[] => Object.keys(operation('post', `/v1/${op}/{key}`).requestBody.content['application/json'].schema.properties);
    expect([fields('encrypt').includes('keyVersion'), fields('encrypt').includes('targetKey')]).toEqual([true, false]);
    expect([fields('decrypt').includes('keyVersion'), fields('decrypt').includes('targetKey')]).toEqual([false, false]);
    expect([fields('rewrap').includes('keyVersion'), fields('rewrap').includes('targetKey')]).toEqual([false, true]);
  });

  it('documents the upload body the route reads itself: NDJSON lines or {"items": [...]}, both of strings', () => {
    const body = operation('post', '/v1/batches').requestBody;
    expect(body.required).toBe(true);
    expect(Object.keys(body.content).sort()).toEqual(['application/json', 'application/x-ndjson']);
    expect(body.content['application/x-ndjson'].schema).toMatchObject({ type: 'string', format: 'binary' });
    const json = new Ajv({ strict: false }).compile(body.content['application/json'].schema);
    expect([json({ items: ['LIC-1'] }), json({ items: [{ plaintext: 'LIC-1' }] }), json({ items: [] }), json(['LIC-1'])]).toEqual([true, false, false, false]);
  });

  it('documents what /results and /events stream, and the errors they answer', () => {
    const results = operation('get', '/v1/batches/{id}/results').responses;
    expect(Object.keys(results['200'].content)).toEqual(['application/x-ndjson']);
    expect(codesOf(results['404'])).toEqual(['KF_BATCH_NOT_FOUND']);
    expect(codesOf(results['409'])).toEqual(['KF_BATCH_NOT_READY', 'KF_BATCH_FAILED']);
    expect(codesOf(results['410'])).toEqual(['KF_BATCH_DELETED']);
    const events = operation('get', '/v1/batches/{id}/events').responses;
    expect(Object.keys(events['200'].content)).toEqual(['text/event-stream']);
    expect(codesOf(events['404'])).toEqual(['KF_BATCH_NOT_FOUND']);
    for (const answer of [results['404'], results['409'], results['410'], events['404'], results['4XX'], events['4XX']]) {
      expect(answer.content['application/json'].schema.properties.error.required).toEqual(['code', 'message']);
    }
  });

  it('documents Idempotency-Key on the routes that take it, as the API checks it, and Idempotent-Replayed on their answers', () => {
    const taking: string[] = [];
    for (const [method, path, op] of operations()) {
      const header = op['parameters']?.find((p: Operation) => p['in'] === 'header' && p['name'] === 'Idempotency-Key');
      if (!header) continue;
      taking.push(`${method.toUpperCase()} ${path}`);
      expect(header.required).toBe(false);
      const pattern = new RegExp(header.schema.pattern);
      // The document's rule and the API's (producer/idempotency.ts) agree.
      for (const key of ['a', 'import 2026-11-23 ~', 'x'.repeat(255), '', 'x'.repeat(256), 'é', 'a\tb', '\x7f']) {
        const documented = pattern.test(key) && key.length >= header.schema.minLength && key.length <= header.schema.maxLength;
        expect([key, documented]).toEqual([key, takesIdempotencyKey(key)]);
      }
      for (const [status, answer] of Object.entries<Operation>(op['responses'])) {
        expect([status, answer['headers']?.['Idempotent-Replayed'] !== undefined]).toEqual([status, status.startsWith('2')]);
      }
    }
    expect(taking.sort()).toEqual(['POST /v1/batches', 'POST /v1/decrypt/{key}', 'POST /v1/encrypt/{key}', 'POST /v1/keys/{name}', 'POST /v1/rewrap/{key}']);
  });

  it('documents a key creation body as optional and a key deletion 204 as having no content', () => {
    expect(operation('post', '/v1/keys/{name}').requestBody.required).toBe(false);
    expect(operation('patch', '/v1/keys/{name}').requestBody.required).toBe(true);
    const deleted = operation('delete', '/v1/keys/{name}').responses['204'];
    expect(deleted.description).toBeTruthy();
    expect(deleted).not.toHaveProperty('content');
    expect(JSON.stringify(doc)).not.toContain('x-keyfleet-');
  });

  it('documents 503 with Retry-After where the backing store is used, and 429 with Retry-After where limits apply', () => {
    expect(codesOf(operation('get', '/readyz').responses['503'])).toEqual(['KF_REDIS_UNAVAILABLE']);
    expect(operation('get', '/healthz').responses).not.toHaveProperty('503');
    for (const [method, path, op] of operations().filter(([, path]) => path.startsWith('/v1/'))) {
      const busy = op['requestBody'] !== undefined && path !== '/v1/batches'; // uploads are streamed: not counted as bodies held
      expect([method, path, codesOf(op['responses']['503'])]).toEqual([method, path, [...(busy ? ['KF_BUSY'] : []), 'KF_REDIS_UNAVAILABLE', 'KF_REDIS_FULL']]);
    }
    // The sync routes' rate limit, and the limits on batches (a sync request may become one).
    const limited = ['/v1/encrypt/{key}', '/v1/decrypt/{key}', '/v1/rewrap/{key}', '/v1/batches'];
    for (const path of limited) expect(codesOf(operation('post', path).responses['429'])).toEqual([...(path === '/v1/batches' ? [] : ['KF_RATE_LIMITED']), 'KF_TOO_MANY_BATCHES', 'KF_BACKLOG_FULL']);
    for (const [method, path, op] of operations()) {
      const { responses } = op;
      for (const status of ['429', '503'].filter((s) => responses[s])) expect([method, path, status, responses[status].headers?.['Retry-After']?.schema]).toEqual([method, path, status, { type: 'integer' }]);
      if (method !== 'post' || !limited.includes(path)) expect([method, path, responses['429']]).toEqual([method, path, undefined]);
    }
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
