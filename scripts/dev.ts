/**
 * `npm start`: the all-in-one dev run. Finds a Redis (REDIS_URL, or starts a local
 * `redis-server` when none answers), makes a dev master key and token once and keeps them in
 * `.keyfleet-dev/` (git-ignored, so yesterday's ciphertexts still decrypt), then runs the API
 * and one worker as child processes and prints how to call them.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { API_NODE_FLAGS } from '../producer/node-flags.js';
import { DEFAULT_WORKER_METRICS_PORT, redisUrls, shownRedisUrl } from '../shared/config.js';
import { freePort, portInUse, redisAnswers, stopChild, waitForOk, waitForRedis } from './local-net.js';

const root = resolve(import.meta.dirname, '..', '..');
const devDir = join(root, '.keyfleet-dev');
const secretsFile = join(devDir, 'secrets.json');

interface DevSecrets {
  masterKey: string;
  token: string;
}

function devSecrets(): DevSecrets {
  if (existsSync(secretsFile)) return JSON.parse(readFileSync(secretsFile, 'utf8')) as DevSecrets;
  mkdirSync(devDir, { recursive: true });
  const secrets = { masterKey: randomBytes(32).toString('base64'), token: `kf_dev_${randomBytes(18).toString('base64url')}` };
  writeFileSync(secretsFile, JSON.stringify(secrets, null, 2) + '\n', { mode: 0o600 });
  return secrets;
}

const children: ChildProcess[] = [];

async function startRedis(): Promise<string> {
  const port = await freePort();
  const dir = join(devDir, 'redis');
  mkdirSync(dir, { recursive: true });
  const redis = spawn('redis-server', ['--port', String(port), '--bind', '127.0.0.1', '--dir', dir, '--appendonly', 'yes', '--maxmemory-policy', 'noeviction', '--save', ''], { stdio: 'ignore' });
  children.push(redis);
  await new Promise<void>((ok, fail) => {
    redis.once('error', (err) => fail(new Error(`no Redis answers and redis-server could not be started: ${err.message}`)));
    redis.once('spawn', () => ok());
  });
  const url = `redis://127.0.0.1:${port}`;
  await waitForRedis(url, 5_000);
  return url;
}

function run(name: string, script: string, env: NodeJS.ProcessEnv, flags: readonly string[] = []): ChildProcess {
  const child = spawn(process.execPath, [...flags, join(root, 'dist', script)], { env, stdio: ['ignore', 'inherit', 'inherit'] });
  child.once('exit', (code, signal) => {
    if (!stopped) {
      // Exit 0 comes only after a drain, which only SIGTERM or SIGINT starts: one sent to the child alone.
      const why = code === 0 ? '0: it was sent SIGTERM or SIGINT, and drained' : (signal ?? code);
      console.error(`keyfleet ${name} exited (${why}); stopping`);
      void stop(1);
    }
  });
  children.push(child);
  return child;
}

/** Stops every child, then exits with `code`; the first call decides, later ones wait for it. */
let stopped: Promise<never> | undefined;
function stop(code: number): Promise<never> {
  stopped ??= Promise.all(children.reverse().map(stopChild)).then(() => process.exit(code));
  return stopped;
}

/**
 * The runner's own failures (no Redis and no redis-server, an API that never answers): a plain
 * line for the person at the terminal, not a stack trace, then everything stopped. A child that
 * exited has said why in its own log line and started the stop already.
 */
function giveUp(err: Error): Promise<never> {
  if (!stopped) console.error(`keyfleet: ${err.message}; stopping`);
  return stop(1);
}

const host = process.env['HOST'] ?? '127.0.0.1';
const port = process.env['PORT'] ?? '8080';
// Another process on the port (another checkout's `npm start`) would answer the readiness check
// meant for this API, which fails to listen: the banner would show the other service. (A PORT
// that is not a port number, or one this user may not take, is the API's to refuse, naming it.)
if (await portInUse(Number(port))) await giveUp(new Error(`port ${port} is taken (another keyfleet running?); set PORT to a free one`));
// So with the worker's: it would fail once the API is ready, after the banner. (0 is any free port.)
const metricsPort = process.env['WORKER_METRICS_PORT'] || String(DEFAULT_WORKER_METRICS_PORT);
if (Number(metricsPort) > 0 && (await portInUse(Number(metricsPort)))) await giveUp(new Error(`the worker's metrics port ${metricsPort} is taken (another keyfleet running?); set WORKER_METRICS_PORT to a free one, or to 0 for any`));
// Set but empty, as the API and the worker refuse it: probed as is, it would be whichever Redis
// answers on 127.0.0.1, or a new one.
if (process.env['REDIS_URL']?.trim() === '') await giveUp(new Error('REDIS_URL is set but empty: unset it for redis://127.0.0.1:6379 (or a Redis of its own), or set a URL'));
// Made and kept only where the environment gives no master key or tokens of its own.
let secrets: DevSecrets | undefined;
const dev = (): DevSecrets => (secrets ??= devSecrets());
let redisUrl = process.env['REDIS_URL'] ?? 'redis://127.0.0.1:6379';
// A cluster's seed list (REDIS_CLUSTER=true) is probed at its first node.
if (!(await redisAnswers(redisUrls(redisUrl)[0]!))) {
  // A Redis named on purpose is not swapped for a throwaway one: a mistyped URL would otherwise
  // run on data that goes nowhere the user meant.
  if (process.env['REDIS_URL'] !== undefined) await giveUp(new Error(`no Redis answers at REDIS_URL (${shownRedisUrl(redisUrl)}): start it or correct the URL, or unset REDIS_URL to have npm start run a redis-server of its own`));
  console.log(`No Redis answers at ${shownRedisUrl(redisUrl)}; starting redis-server for this session (data in .keyfleet-dev/redis).`);
  redisUrl = await startRedis().catch(giveUp);
}
// Dev data gets its own prefix per dev master key, so checkouts sharing a local Redis (or a
// Redis that also holds other data) never meet each other's keys.
const masterKey = process.env['KEYFLEET_MASTER_KEY'] ?? dev().masterKey;
const prefix = process.env['KEYFLEET_PREFIX'] ?? `{keyfleet-dev-${createHash('sha256').update(masterKey).digest('hex').slice(0, 8)}}`;
const env: NodeJS.ProcessEnv = {
  ...process.env,
  REDIS_URL: redisUrl,
  HOST: host,
  PORT: port,
  KEYFLEET_MASTER_KEY: masterKey,
  KEYFLEET_PREFIX: prefix,
  KEYFLEET_TOKENS: process.env['KEYFLEET_TOKENS'] ?? `dev:${dev().token}:encrypt+decrypt+rewrap+keys+batches+admin`,
  LOG_LEVEL: process.env['LOG_LEVEL'] ?? 'warn',
};
for (const signal of ['SIGINT', 'SIGTERM'] as const) process.once(signal, () => void stop(0));

const api = run('api', 'producer/main.js', env, API_NODE_FLAGS);
run('worker', 'worker/main.js', env);
const url = `http://${host}:${port}`;
await waitForOk(`${url}/readyz`, 'the API', api).catch(giveUp);
// A child that exited meanwhile (a worker whose port is taken) is stopping everything: no banner.
if (stopped) await stopped;

const ownTokens = Boolean(process.env['KEYFLEET_TOKENS']);
const token = ownTokens ? '<a token from your KEYFLEET_TOKENS>' : dev().token;
const auth = `-H "Authorization: Bearer ${token}"`;
console.log(`
keyfleet is running (API + 1 worker, Redis at ${shownRedisUrl(redisUrl)}, keys under ${prefix})

  URL:        ${url}
  ${ownTokens ? 'tokens:     yours, from KEYFLEET_TOKENS (use one with the keys and encrypt scopes below)' : `dev token:  ${token}   (tenant "dev", all scopes; kept in .keyfleet-dev/secrets.json)`}

Try it:
  curl -s -X POST ${url}/v1/keys/serials ${auth}
  curl -s -X POST ${url}/v1/encrypt/serials ${auth} -H 'content-type: application/json' -d '{"items":["LIC-0001","LIC-0002"]}'

Ctrl-C stops everything.
`);
