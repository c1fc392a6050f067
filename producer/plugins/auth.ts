import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import fp from 'fastify-plugin';
import type { KeyCache } from '../../shared/key-cache.js';
import { KeyfleetError } from '../../shared/errors.js';
import { MAX_TOKEN_LENGTH, TOKEN_CHARACTERS, type Principal, type Scope, type TokenVerifier } from '../../shared/tokens.js';
import { DOCS_PATH } from './docs.js';

declare module 'fastify' {
  interface FastifyRequest {
    principal: Principal | undefined;
  }
  interface FastifyContextConfig {
    /** The scope a route needs; `public` routes need no token at all. */
    scope?: Scope | 'public';
  }
}

// Bounded so a huge header costs nothing to reject; KEYFLEET_TOKENS refuses the tokens this
// could not read (longer ones, or ones of other characters).
const BEARER = new RegExp(`^Bearer ([${TOKEN_CHARACTERS}]{1,${MAX_TOKEN_LENGTH}})$`, 'i');
const BASIC = /^Basic ([A-Za-z0-9+/=]{1,1024})$/i;

/** The token of a request: `Bearer <token>`, or HTTP Basic with the token as password (for browsers). */
function presentedToken(header: string | undefined): string | undefined {
  if (!header) return undefined;
  const bearer = BEARER.exec(header);
  if (bearer) return bearer[1];
  const basic = BASIC.exec(header);
  if (!basic?.[1]) return undefined;
  const decoded = Buffer.from(basic[1], 'base64').toString('utf8');
  const colon = decoded.indexOf(':');
  return colon === -1 ? undefined : decoded.slice(colon + 1);
}

/** Bearer-token authentication and per-route scopes. Unknown or missing tokens are 401, a missing scope 403. */
export const authPlugin = fp(async (app: FastifyInstance, { verifier }: { verifier: TokenVerifier }) => {
  app.decorateRequest('principal', undefined);
  // A callback hook, not an async one: it runs on every request, and the sync path is priced in microseconds.
  app.addHook('onRequest', (request, reply, done) => {
    // The request id goes back on every answer, so a caller can quote it (set here: no extra hook).
    reply.header('x-request-id', request.id);
    const route = request.routeOptions; // a getter that builds a new object on every read
    const scope = route.config.scope;
    // Swagger UI's own routes carry no config of ours; the API description is public.
    if (scope === 'public' || route.url?.startsWith(DOCS_PATH)) return done();
    const token = presentedToken(request.headers.authorization);
    const principal = token ? verifier.verify(token) : undefined;
    if (!principal) {
      // Browsers only offer a sign-in prompt for a Basic challenge: give it on the admin UI.
      reply.header('www-authenticate', request.url.startsWith('/admin') ? 'Basic realm="keyfleet admin", charset="UTF-8"' : 'Bearer realm="keyfleet"');
      deny(reply, new KeyfleetError('KF_UNAUTHORIZED'));
      return undefined;
    }
    // No per-request child logger (it costs more than sealing ten items): lines that concern
    // a tenant's data name the tenant themselves.
    request.principal = principal;
    if (scope && !hasScope(principal, scope)) {
      deny(reply, forbidden([scope]));
      return undefined;
    }
    return done();
  });
});

/** The authenticated principal of a request that passed the auth hook. */
export function principalOf(request: FastifyRequest): Principal {
  if (!request.principal) throw new KeyfleetError('KF_UNAUTHORIZED');
  return request.principal;
}

export function requireScope(request: FastifyRequest, ...anyOf: Scope[]): Principal {
  const principal = principalOf(request);
  if (!hasScope(principal, ...anyOf)) throw forbidden(anyOf);
  return principal;
}

export const hasScope = (principal: Principal, ...anyOf: Scope[]): boolean => anyOf.some((s) => principal.scopes.has(s));

/**
 * A rewrap of `key` (into `targetKey`, where given) needs the decrypt scope as well where its
 * outcome tells something of the plaintexts; a rewrap-only token must not be a way to read them.
 * - Out of a legacy CBC key: CBC has no integrity, so whether a rewrap of a doctored ciphertext
 *   succeeds tells whether its padding held: a padding oracle that reads the plaintext byte by byte.
 * - Into a convergent key (the target key, or the source itself): equal plaintexts under one
 *   context come out as equal ciphertexts, so rewrapped items show which are equal, and beside
 *   encrypt, whether a guess is right (a PIN, a serial).
 */
export async function requireRewrapScope(request: FastifyRequest, keyCache: KeyCache, key: string, targetKey: string | undefined): Promise<void> {
  const principal = principalOf(request);
  if (hasScope(principal, 'decrypt')) return;
  const source = await keyCache.get(principal.tenant, key);
  if (source.type === 'legacy-aes256-cbc') {
    throw new KeyfleetError('KF_FORBIDDEN', 'rewrapping out of a legacy-aes256-cbc key needs the decrypt scope as well as rewrap');
  }
  const sealing = targetKey === undefined ? source : await keyCache.get(principal.tenant, targetKey);
  if (sealing.convergent) {
    throw new KeyfleetError('KF_FORBIDDEN', 'rewrapping into a convergent key needs the decrypt scope as well as rewrap: its ciphertexts show which plaintexts are equal');
  }
}

const forbidden = (anyOf: readonly Scope[]): KeyfleetError => new KeyfleetError('KF_FORBIDDEN', `the token lacks the ${anyOf.join(' or ')} scope`);

/**
 * Answers a refused request from a hook directly rather than by throwing, so the answer is the
 * same under plugins that bring their own error handler (Bull Board does).
 */
export function deny(reply: FastifyReply, error: KeyfleetError): FastifyReply {
  return reply.status(error.status).send({ error: error.toBody() });
}
