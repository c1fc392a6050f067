import FindMyWay from 'find-my-way';

/**
 * The methods each route path answers, for a 405 with `Allow` where a path exists but not with
 * the method asked (`PUT /v1/keys/serials`): a 404 there would say the key or route is missing.
 * The paths are matched as fastify's router matches them (find-my-way, which fastify is built
 * on), with the same options.
 */
export class RouteMethods {
  readonly #router: FindMyWay.Instance<FindMyWay.HTTPVersion.V1>;
  readonly #methods = new Set<FindMyWay.HTTPMethod>();

  constructor(options: { maxParamLength: number }) {
    this.#router = FindMyWay({ maxParamLength: options.maxParamLength });
  }

  /** Called for each route as it is registered (fastify's onRoute hook). */
  add(method: string | readonly string[], url: string): void {
    for (const m of [method].flat() as FindMyWay.HTTPMethod[]) {
      this.#methods.add(m);
      this.#router.on(m, url, () => {});
    }
  }

  /** The methods `path` (without its query) answers, sorted; none for a path no route has. */
  allowed(path: string): string[] {
    return [...this.#methods].filter((m) => this.#router.find(m, path) !== null).sort();
  }
}
