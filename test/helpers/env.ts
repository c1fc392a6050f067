import { randomBytes } from 'node:crypto';
import { inject } from 'vitest';
import { loadConfig, type Config } from '../../shared/config.js';

export interface TestTenant {
  readonly tenant: string;
  readonly token: string;
}

/** A fresh environment per test file: its own `{hash tag}` prefix, master key and tokens. */
export function testEnv(overrides: Record<string, string> = {}): { env: Record<string, string>; admin: TestTenant; encryptOnly: TestTenant; other: TestTenant } {
  const admin = { tenant: 'acme', token: `tok_${randomBytes(16).toString('hex')}` };
  const encryptOnly = { tenant: 'acme', token: `tok_${randomBytes(16).toString('hex')}` };
  const other = { tenant: 'globex', token: `tok_${randomBytes(16).toString('hex')}` };
  const env: Record<string, string> = {
    REDIS_URL: inject('redisUrl'),
    KEYFLEET_PREFIX: `{kft-${randomBytes(4).toString('hex')}}`,
    KEYFLEET_MASTER_KEY: randomBytes(32).toString('base64'),
    KEYFLEET_TOKENS: [
      `${admin.tenant}:${admin.token}:encrypt+decrypt+rewrap+keys+batches+admin`,
      `${encryptOnly.tenant}:${encryptOnly.token}:encrypt`,
      `${other.tenant}:${other.token}`,
    ].join(','),
    LOG_LEVEL: 'warn',
    // Each worker process picks a free port for its metrics server.
    WORKER_METRICS_PORT: '0',
    // Worker processes at normal priority: under the default SCHED_IDLE and nice 19 they would
    // get only the CPU that the test runner and the API leave, and on a loaded CI machine could
    // miss the short job-lock renewals some tests set. The scheduling itself has its own tests:
    // unit/config-and-tokens.test.ts, and the CLI suite's worker at the production default.
    WORKER_SCHED: 'normal',
    WORKER_NICE: '0',
    ...overrides,
  };
  return { env, admin, encryptOnly, other };
}

export const configFrom = (env: Record<string, string>): Config => loadConfig(env);

export const bearer = (t: TestTenant): Record<string, string> => ({ authorization: `Bearer ${t.token}` });

/** A token for a client talking to a stand-in server, not to the API: of a length the client takes (16 to 512 characters). */
export const STAND_IN_TOKEN = 'stand-in-token-0';
