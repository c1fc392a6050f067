import type { FastifyInstance, InjectOptions } from 'fastify';
import { buildApp } from '../../producer/app.js';
import type { Logger } from '../../shared/logger.js';
import { bearer, configFrom, type TestTenant } from './env.js';

/** In-process APIs for a test file, each on its own environment; `close()` closes them all. */
export class TestApis {
  readonly #apps: FastifyInstance[] = [];

  /** With `logger`, the app logs there (a test reading its lines) rather than to stdout. */
  async start(env: Record<string, string>, logger?: Logger): Promise<FastifyInstance> {
    const app = await buildApp({ config: configFrom(env), ...(logger ? { logger } : {}) });
    await app.ready();
    this.#apps.push(app);
    return app;
  }

  async close(): Promise<void> {
    await Promise.all(this.#apps.map((a) => a.close()));
  }
}

/** A request as `who`, through fastify's inject. */
export const call = (app: FastifyInstance, who: TestTenant, method: InjectOptions['method'], url: string, payload?: object | string, headers: Record<string, string> = {}) =>
  app.inject({ method, url, headers: { ...bearer(who), ...headers }, ...(payload === undefined ? {} : { payload }) });
