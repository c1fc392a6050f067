import type { FastifyInstance } from 'fastify';
import type { ZodTypeProvider } from 'fastify-type-provider-zod';
import { createKeyBody, keyParams, patchKeyBody } from '../../shared/schemas.js';
import { principalOf } from '../plugins/auth.js';

/** Named, versioned keys. Routes answer metadata only: key material never leaves the service. */
export async function keyRoutes(app: FastifyInstance): Promise<void> {
  const r = app.withTypeProvider<ZodTypeProvider>();
  const { keyStore, keyCache } = app.services;
  const config = { scope: 'keys' } as const;

  r.post('/v1/keys/:name', { config, schema: { params: keyParams, body: createKeyBody.nullish() } }, async (request, reply) => {
    const { tenant } = principalOf(request);
    const { info, created } = await keyStore.create(tenant, request.params.name, request.body?.type ?? 'aes256-gcm96');
    return reply.status(created ? 201 : 200).send(info);
  });

  r.get('/v1/keys/:name', { config, schema: { params: keyParams } }, async (request) => {
    return keyStore.info(principalOf(request).tenant, request.params.name);
  });

  r.post('/v1/keys/:name/rotate', { config, schema: { params: keyParams } }, async (request) => {
    const { tenant } = principalOf(request);
    const info = await keyStore.rotate(tenant, request.params.name);
    keyCache.forget(tenant, request.params.name);
    return info;
  });

  r.patch('/v1/keys/:name', { config, schema: { params: keyParams, body: patchKeyBody } }, async (request) => {
    const { tenant } = principalOf(request);
    const info = await keyStore.setMinDecryptionVersion(tenant, request.params.name, request.body.minDecryptionVersion);
    keyCache.forget(tenant, request.params.name);
    return info;
  });
}
