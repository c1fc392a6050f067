import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import type { Registry } from 'prom-client';
import { CATALOGUE, retryAfterOf } from '../shared/errors.js';

export interface WorkerHttpOptions {
  readonly host: string;
  readonly port: number;
  readonly registry: Registry;
  /** Readiness: resolves true when the worker can take chunks (Redis answers, not draining). */
  readonly ready: () => Promise<boolean>;
}

/** The worker's 503 from /readyz: the API's for the same cause (code, message, Retry-After). */
const NOT_READY = JSON.stringify({ error: { code: 'KF_REDIS_UNAVAILABLE', message: CATALOGUE.KF_REDIS_UNAVAILABLE.message } });

const ROUTES: ReadonlySet<string> = new Set(['/metrics', '/healthz', '/readyz']);
const NOT_FOUND = JSON.stringify({ error: { code: 'KF_NOT_FOUND', message: CATALOGUE.KF_NOT_FOUND.message } });
const METHOD_NOT_ALLOWED = JSON.stringify({ error: { code: 'KF_METHOD_NOT_ALLOWED', message: CATALOGUE.KF_METHOD_NOT_ALLOWED.message } });

/** A readiness check that has not answered by then is a 503, not a probe left hanging. */
const READY_TIMEOUT_MS = 1_000;

/** A worker's own small HTTP server: /metrics for Prometheus, /healthz and /readyz for probes. */
export async function startWorkerHttp({ host, port, registry, ready }: WorkerHttpOptions): Promise<{ server: Server; port: number }> {
  const server = createServer((req, res) => {
    const path = (req.url ?? '/').split('?')[0];
    const reply = (status: number, type: string, body: string, headers: Record<string, string> = {}): void => {
      res.writeHead(status, { 'content-type': type, ...headers }).end(body);
    };
    // The API's answers for the same cases: 404 for a path it has not, 405 with Allow for a method its paths do not take.
    if (!ROUTES.has(path ?? '')) return reply(404, 'application/json', NOT_FOUND);
    if (req.method !== 'GET' && req.method !== 'HEAD') return reply(405, 'application/json', METHOD_NOT_ALLOWED, { allow: 'GET, HEAD' });
    if (path === '/metrics') {
      registry.metrics().then(
        (text) => reply(200, registry.contentType, text),
        () => reply(500, 'application/json', '{"error":{"code":"KF_INTERNAL","message":"internal error"}}'),
      );
    } else if (path === '/healthz') {
      reply(200, 'application/json', '{"status":"ok"}');
    } else if (path === '/readyz') {
      // The first answer wins: the check's own, or 503 once it has taken READY_TIMEOUT_MS.
      const answer = (ok: boolean): void => {
        clearTimeout(timer);
        if (res.headersSent) return;
        if (ok) reply(200, 'application/json', '{"status":"ready"}');
        else reply(503, 'application/json', NOT_READY, { 'retry-after': String(retryAfterOf('KF_REDIS_UNAVAILABLE')) });
      };
      const timer = setTimeout(() => answer(false), READY_TIMEOUT_MS);
      ready().then(answer, () => answer(false));
    }
  });
  await new Promise<void>((ok, fail) => {
    server.once('error', fail);
    server.listen(port, host, () => ok());
  });
  return { server, port: (server.address() as AddressInfo).port };
}
