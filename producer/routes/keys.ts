import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { z } from 'zod';
import { createKeyBody, errorResponse, importKeyBody, keyInfo, keyList, keyParams, listKeysQuery, newKeyParams, patchKeyBody, trimKeyBody } from '../../shared/schemas.js';
import { answerOnce, jsonAnswer, sendWhenDone } from '../idempotency.js';
import { principalOf } from '../plugins/auth.js';

/** Named, versioned keys. Routes answer metadata only: key material never leaves the service. */
export async function keyRoutes(app: FastifyInstance): Promise<void> {
  const r = app.withTypeProvider<ZodTypeProvider>();
  const { keyStore, keyCache, idempotency } = app.services;
  const config = { scope: 'keys' } as const;
  const tags = ['keys'];
  const answers = { 200: keyInfo, '4xx': errorResponse };

  r.post('/v1/keys/:name', { config, schema: { tags, summary: 'Create a key (201), or find it with the same type (200)', params: newKeyParams, body: createKeyBody.nullish(), response: { ...answers, 201: keyInfo }, docs: { idempotent: true } } }, (request, reply) => {
    const { tenant } = principalOf(request);
    const options = { type: request.body?.type ?? 'aes256-gcm96', convergent: request.body?.convergent ?? false };
    // With an Idempotency-Key, a retry after a lost 201 gets that 201 again, not the 200 of a
    // key found: the caller learns it made the key. The options stand for the body (no body
    // and `{}` ask for the same key).
    sendWhenDone(reply, answerOnce(idempotency, request, reply, tenant, JSON.stringify(options), async () => {
      const { info, created } = await keyStore.create(tenant, request.params.name, options);
      return jsonAnswer(created ? 201 : 200, info);
    }));
  });

  r.post('/v1/keys/:name/import', { config, schema: { tags, summary: 'Import the material of a legacy AES-256-CBC key (201); it only decrypts and rewraps', params: newKeyParams, body: importKeyBody, response: { 201: keyInfo, '4xx': errorResponse } } }, async (request, reply) => {
    const { tenant } = principalOf(request);
    const material = Buffer.from(request.body.material, 'base64');
    try {
      const { info } = await keyStore.create(tenant, request.params.name, { type: request.body.type, material });
      return await reply.status(201).send(info);
    } finally {
      material.fill(0);
    }
  });

  r.get('/v1/keys', { config, schema: { tags, summary: 'The tenant’s keys in name order, `limit` (100; at most 1,000) a page; `next` is the `after` of the page that follows', querystring: listKeysQuery, response: { 200: keyList, '4xx': errorResponse } } }, async (request) => {
    return keyStore.list(principalOf(request).tenant, request.query);
  });

  r.get('/v1/keys/:name', { config, schema: { tags, summary: 'A key’s metadata (never its material)', params: keyParams, response: answers } }, async (request) => {
    return keyStore.info(principalOf(request).tenant, request.params.name);
  });

  r.post('/v1/keys/:name/rotate', { config, schema: { tags, summary: 'Add a new version; new ciphertexts use it', params: keyParams, response: answers } }, async (request) => {
    const { tenant } = principalOf(request);
    const info = await keyStore.rotate(tenant, request.params.name);
    keyCache.forget(tenant, request.params.name);
    return info;
  });

  r.patch('/v1/keys/:name', { config, schema: { tags, summary: 'Key policy: minDecryptionVersion, deletionAllowed, autoRotatePeriod (seconds)', params: keyParams, body: patchKeyBody, response: answers } }, async (request) => {
    const { tenant } = principalOf(request);
    const info = await keyStore.patch(tenant, request.params.name, request.body);
    keyCache.forget(tenant, request.params.name);
    return info;
  });

  r.post('/v1/keys/:name/trim', { config, schema: { tags, summary: 'Delete the material of versions below minAvailableVersion (at most minDecryptionVersion)', params: keyParams, body: trimKeyBody, response: answers } }, async (request) => {
    const { tenant } = principalOf(request);
    const info = await keyStore.trim(tenant, request.params.name, request.body.minAvailableVersion);
    keyCache.forget(tenant, request.params.name);
    return info;
  });

  r.delete('/v1/keys/:name', { config, schema: { tags, summary: 'Delete a key marked deletionAllowed (204); every ciphertext under it is lost', params: keyParams, response: { 204: z.null().describe('the key is gone'), '4xx': errorResponse } } }, async (request, reply) => {
    const { tenant } = principalOf(request);
    await keyStore.delete(tenant, request.params.name);
    keyCache.forget(tenant, request.params.name);
    return reply.status(204).send(null);
  });
}
