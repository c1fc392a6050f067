import { hash, timingSafeEqual } from 'node:crypto';

export const SCOPES = ['encrypt', 'decrypt', 'rewrap', 'keys', 'batches', 'admin'] as const;
export type Scope = (typeof SCOPES)[number];

/** An entry without scopes may do everything but administer the service. */
const DEFAULT_SCOPES: readonly Scope[] = SCOPES.filter((s) => s !== 'admin');

export interface TokenEntry {
  readonly tenant: string;
  readonly token: string;
  readonly scopes: ReadonlySet<Scope>;
}

export interface Principal {
  readonly tenant: string;
  readonly scopes: ReadonlySet<Scope>;
}

const NAME = /^[A-Za-z0-9._-]{1,64}$/;

/** The longest token: the API reads at most this many characters after `Bearer ` (auth plugin). */
export const MAX_TOKEN_LENGTH = 512;
/** The shortest token KEYFLEET_TOKENS takes: a shorter one could be guessed, and never authenticates. */
export const MIN_TOKEN_LENGTH = 16;

/**
 * The characters of a token, as a regex class: visible ASCII, what the auth plugin reads after
 * `Bearer `. RFC 6750's b64token (letters, digits, `-._~+/`, trailing `=`) is a subset, and what
 * generated tokens use; the other visible characters authenticate as well, so they stay allowed.
 * A space, a control or a non-ASCII character could only ever be sent through HTTP Basic.
 */
export const TOKEN_CHARACTERS = '\\x21-\\x7e';
const TOKEN = new RegExp(`^[${TOKEN_CHARACTERS}]+$`);

/**
 * Parses `tenant:token[:scope+scope…]` entries separated by commas. Errors name an entry by its
 * number and never show any of its text: a field is only known for what it is once the entry
 * parses (`<token>:encrypt`, a tenant left out, would read the token as the tenant name; a
 * token holding a `:` would show its tail as a scope).
 */
export function parseTokens(spec: string): TokenEntry[] {
  const isScope = (s: string): boolean => (SCOPES as readonly string[]).includes(s);
  const entries = spec.split(',').map((s) => s.trim()).filter(Boolean);
  const entryOf = new Map<string, number>(); // each token's entry
  return entries.map((entry, index) => {
    const fail: (expected: string) => never = (expected) => {
      throw new Error(`entry ${index + 1}: expected ${expected}`);
    };
    const [tenant, token, scopeList, extra] = entry.split(':');
    if (token === undefined || extra !== undefined) fail('tenant:token[:scope+scope] (a token holds no : or ,)');
    if (!tenant || !NAME.test(tenant)) fail('a tenant name of [A-Za-z0-9._-], 1-64 characters');
    if (token.length < MIN_TOKEN_LENGTH) fail(`a token of at least ${MIN_TOKEN_LENGTH} characters`);
    // A longer one could never authenticate. Its length, not its content, goes in the message.
    if (token.length > MAX_TOKEN_LENGTH) fail(`a token of at most ${MAX_TOKEN_LENGTH} characters, got ${token.length}`);
    if (!TOKEN.test(token)) fail('a token of visible ASCII characters (! to ~: no space, control or non-ASCII character), as Authorization: Bearer carries it');
    // `<token>:encrypt+decrypt+…`, the tenant left out, would make the token the tenant's name
    // (logged with every request) and the scope list a token anyone could guess.
    if (token.split('+').every(isScope)) fail('tenant:token[:scope+scope], got scopes where the token goes (is the tenant missing?)');
    const scopes = scopeList === undefined || scopeList === '' ? DEFAULT_SCOPES : scopeList.split('+');
    if (!scopes.every(isScope)) fail(`scopes among ${SCOPES.join(', ')}, joined by +`);
    // A token names one principal: a second entry with it would never be the one found.
    const first = entryOf.get(token);
    if (first !== undefined) fail(`a token of its own, got the token of entry ${first + 1} (a token stands for one tenant and its scopes)`);
    entryOf.set(token, index);
    return { tenant, token, scopes: new Set(scopes as Scope[]) };
  });
}

/**
 * Finds a token among SHA-256 digests laid end to end: the index of the first that is the
 * token's, or -1. Every digest is compared in full, matched or not.
 */
export type DigestMatcher = (token: string, digests: Uint8Array) => number;

const DIGEST_BYTES = 32;

// One-shot hash: no Hash object per request.
const digest = (token: string): Buffer => hash('sha256', token, 'buffer');

/**
 * node:crypto's matcher; the API uses the native kernel's tokenIndex where it is built (a
 * tenth of the cost). Both find a token of more than MAX_TOKEN_LENGTH UTF-8 bytes nowhere:
 * no entry is longer (parseTokens).
 */
export const matchDigest: DigestMatcher = (token, digests) => {
  if (token.length > MAX_TOKEN_LENGTH || Buffer.byteLength(token, 'utf8') > MAX_TOKEN_LENGTH) return -1;
  const presented = digest(token);
  let found = -1;
  for (let i = 0; i < digests.length / DIGEST_BYTES; i++) {
    if (timingSafeEqual(digests.subarray(i * DIGEST_BYTES, (i + 1) * DIGEST_BYTES), presented) && found < 0) found = i;
  }
  return found;
};

/**
 * Resolves bearer tokens to principals. Tokens are compared as SHA-256 digests, in constant
 * time against every entry, so neither the match position nor the length leaks.
 */
export class TokenVerifier {
  readonly #digests: Uint8Array;
  readonly #principals: readonly Principal[];
  readonly #match: DigestMatcher;

  constructor(entries: readonly TokenEntry[], match: DigestMatcher = matchDigest) {
    // parseTokens takes none longer; a longer one would be found by neither matcher.
    if (entries.some((e) => Buffer.byteLength(e.token, 'utf8') > MAX_TOKEN_LENGTH)) throw new RangeError(`a token of at most ${MAX_TOKEN_LENGTH} bytes`);
    this.#digests = Buffer.concat(entries.map((e) => digest(e.token)));
    this.#principals = entries.map((e) => ({ tenant: e.tenant, scopes: e.scopes }));
    this.#match = match;
  }

  get size(): number {
    return this.#principals.length;
  }

  verify(token: string): Principal | undefined {
    return this.#principals[this.#match(token, this.#digests)];
  }
}
