import type { FastifyInstance } from 'fastify';
import fp from 'fastify-plugin';

/** Times every request by route template (never by raw URL: no ids or key names in labels) and serves /metrics. */
export const metricsPlugin = fp(async (app: FastifyInstance) => {
  const { metrics, registry } = app.services;
  app.addHook('onResponse', (request, reply, done) => {
    metrics.observeRequest(request.method, request.routeOptions.url ?? 'unmatched', reply.statusCode, reply.elapsedTime / 1000);
    done();
  });
  // Public like /healthz: metrics carry counts and timings, no secrets and no tenant data.
  app.get('/metrics', { config: { scope: 'public' } }, async (_request, reply) => {
    reply.header('content-type', registry.contentType);
    return registry.metrics();
  });
});
