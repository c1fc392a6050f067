import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { createKeyBody, errorResponse, keyInfo, keyParams, patchKeyBody } from '../../shared/schemas.js';
import { principalOf } from '../plugins/auth.js';

/** Named, versioned keys. Routes answer metadata only: key material never leaves the service. */
export async function keyRoutes(app: FastifyInstance): Promise<void> {
  const r = app.withTypeProvider<ZodTypeProvider>();
  const { keyStore, keyCache } = app.services;
  const config = { scope: 'keys' } as const;
  const tags = ['keys'];
  const answers = { 200: keyInfo, '4xx': errorResponse };

  r.post('/v1/keys/:name', { config, schema: { tags, summary: 'Create a key (201), or find it with the same type (200)', params: keyParams, body: createKeyBody.nullish(), response: { ...answers, 201: keyInfo } } }, async (request, reply) => {
    const { tenant } = principalOf(request);
    const { info, created } = await keyStore.create(tenant, request.params.name, request.body?.type ?? 'aes256-gcm96');
    return reply.status(created ? 201 : 200).send(info);
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

  r.patch('/v1/keys/:name', { config, schema: { tags, summary: 'Retire versions below minDecryptionVersion', params: keyParams, body: patchKeyBody, response: answers } }, async (request) => {
    const { tenant } = principalOf(request);
    const info = await keyStore.setMinDecryptionVersion(tenant, request.params.name, request.body.minDecryptionVersion);
    keyCache.forget(tenant, request.params.name);
    return info;
  });
}
