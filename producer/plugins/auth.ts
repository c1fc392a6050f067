import type { FastifyInstance, FastifyRequest } from 'fastify';
import fp from 'fastify-plugin';
import { KeyfleetError } from '../../shared/errors.js';
import type { Principal, Scope, TokenVerifier } from '../../shared/tokens.js';

declare module 'fastify' {
  interface FastifyRequest {
    principal: Principal | undefined;
  }
  interface FastifyContextConfig {
    /** The scope a route needs; `public` routes need no token at all. */
    scope?: Scope | 'public';
  }
}

const BEARER = /^Bearer ([\x21-\x7e]{1,512})$/i;

/** Bearer-token authentication and per-route scopes. Unknown or missing tokens are 401, a missing scope 403. */
export const authPlugin = fp(async (app: FastifyInstance, { verifier }: { verifier: TokenVerifier }) => {
  app.decorateRequest('principal', undefined);
  app.addHook('onRequest', async (request) => {
    const scope = request.routeOptions.config.scope;
    if (scope === 'public') return;
    const match = BEARER.exec(request.headers.authorization ?? '');
    const principal = match?.[1] ? verifier.verify(match[1]) : undefined;
    if (!principal) throw new KeyfleetError('KF_UNAUTHORIZED');
    request.principal = principal;
    request.log = request.log.child({ tenant: principal.tenant });
    if (scope) requireScope(request, scope);
  });
});

/** The authenticated principal of a request that passed the auth hook. */
export function principalOf(request: FastifyRequest): Principal {
  if (!request.principal) throw new KeyfleetError('KF_UNAUTHORIZED');
  return request.principal;
}

export function requireScope(request: FastifyRequest, ...anyOf: Scope[]): Principal {
  const principal = principalOf(request);
  if (!anyOf.some((s) => principal.scopes.has(s))) {
    throw new KeyfleetError('KF_FORBIDDEN', `the token lacks the ${anyOf.join(' or ')} scope`);
  }
  return principal;
}
