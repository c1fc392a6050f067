import type { ServerResponse } from 'node:http';

type Tracked = ServerResponse & { [HELD]?: number; [OWNER]?: string };
const HELD = Symbol('keyfleet.bodyBytesHeld');
const OWNER = Symbol('keyfleet.bodyOwner');

/** Which bound a body would pass: the API's (MAX_BODY_BYTES_IN_FLIGHT) or its tenant's share. */
export type BodyRefusal = 'api' | 'tenant';

/**
 * A bound on the request bodies the API holds at once. fastify reads a JSON body whole (up to
 * MAX_BODY_BYTES) before the handler runs, and by its answer a request has taken several times
 * its body (the bytes, the text, the parsed items, the results): sixteen 16 MB encrypt requests
 * at once took an API to 903–977 MB (ad hoc, sync and batch-making bodies alike), past the 512
 * MiB its Kubernetes limit allows, and an API killed for memory takes every upload and download
 * in flight with it. With the default 48 MiB in flight: 327–374 MB, three taken and thirteen
 * answered 503.
 *
 * The body watch (body-timeout.ts) reserves a request's Content-Length before the body is read,
 * and counts a chunked body piece by piece as it arrives (or whole, when it came with the
 * headers); what a response reserved is given back when it closes. A body that would take the
 * bodies held past `limit` (MAX_BODY_BYTES_IN_FLIGHT) is refused, unless it is the only one held:
 * a limit below MAX_BODY_BYTES slows the API down rather than shutting large bodies out.
 *
 * Each tenant's bodies are also bound by `tenantLimit` (MAX_TENANT_BODY_BYTES_IN_FLIGHT), unless
 * the body is the only one the tenant holds. Without it, one tenant's three 16 MiB bodies sent a
 * byte at a time (each byte within UPLOAD_IDLE_SECONDS of the last) held the whole default budget
 * for as long as they liked, and every other tenant's sync and key requests were answered 503.
 */
export class BodyBudget {
  #held = 0;
  /** What each tenant holds ('' for requests without one); a tenant holding nothing has no entry. */
  readonly #byTenant = new Map<string, number>();
  readonly #limit: number;
  readonly #tenantLimit: number;
  readonly #maxBodyBytes: number;

  /** The 'close' listener of every tracked response (`this`): one function, no closure per request. */
  readonly #release: (this: Tracked) => void;

  constructor(limit: number, tenantLimit: number, maxBodyBytes: number) {
    this.#limit = limit;
    this.#tenantLimit = tenantLimit;
    this.#maxBodyBytes = maxBodyBytes;
    const budget = this;
    this.#release = function (this: Tracked): void {
      const held = this[HELD] ?? 0;
      budget.#held -= held;
      budget.#add(this[OWNER]!, -held);
    };
  }

  /** Adds `bytes` to what `tenant` holds; what it holds now. */
  #add(tenant: string, bytes: number): number {
    const held = (this.#byTenant.get(tenant) ?? 0) + bytes;
    if (held > 0) this.#byTenant.set(tenant, held);
    else this.#byTenant.delete(tenant);
    return held;
  }

  /**
   * Reserves `bytes` (at most MAX_BODY_BYTES: fastify refuses a longer body with 413) for the body
   * of `tenant` answered by `res`, until it closes; undefined when it is reserved, or the bound it
   * would pass (nothing reserved).
   */
  reserve(res: ServerResponse, bytes: number, tenant: string): BodyRefusal | undefined {
    const taken = Math.min(bytes, this.#maxBodyBytes);
    if (this.#held > 0 && this.#held + taken > this.#limit) return 'api';
    const own = this.#byTenant.get(tenant) ?? 0;
    if (own > 0 && own + taken > this.#tenantLimit) return 'tenant';
    this.#held += taken;
    if (taken > 0) this.#byTenant.set(tenant, own + taken);
    (res as Tracked)[HELD] = taken;
    (res as Tracked)[OWNER] = tenant;
    // 'close' comes once, when the answer is sent or the connection is gone before it.
    res.on('close', this.#release);
    return undefined;
  }

  /**
   * Counts `bytes` more of a body `res` reserved for; the bound passed once the bodies held pass
   * the limit, or its tenant's pass the tenant's (they stay counted until it closes).
   */
  grow(res: ServerResponse, bytes: number): BodyRefusal | undefined {
    const tracked = res as Tracked;
    const mine = (tracked[HELD] = (tracked[HELD] ?? 0) + bytes);
    this.#held += bytes;
    const own = this.#add(tracked[OWNER]!, bytes);
    if (this.#held > this.#limit && mine !== this.#held) return 'api';
    return own > this.#tenantLimit && mine !== own ? 'tenant' : undefined;
  }
}
