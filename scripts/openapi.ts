/**
 * `npm run openapi`: writes openapi.json, the API description generated from the routes' zod
 * schemas (the same document /docs/json serves). A test fails when the committed file is stale.
 */
import { randomBytes } from 'node:crypto';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { buildApp } from '../producer/app.js';
import { loadConfig } from '../shared/config.js';
import { projectRoot } from '../shared/project-root.js';

/** The OpenAPI document as the API describes itself, formatted as committed. */
export async function generateOpenApi(): Promise<string> {
  // Any valid configuration will do: the document depends on the routes, not on secrets or Redis.
  const config = loadConfig({ KEYFLEET_MASTER_KEY: randomBytes(32).toString('base64'), KEYFLEET_TOKENS: `docs:${randomBytes(16).toString('hex')}`, LOG_LEVEL: 'silent', REDIS_URL: process.env['REDIS_URL'] ?? 'redis://127.0.0.1:6379' });
  const app = await buildApp({ config });
  try {
    await app.ready();
    return JSON.stringify(app.swagger(), null, 2) + '\n';
  } finally {
    await app.close();
  }
}

if (process.argv[1] === import.meta.filename) {
  const file = join(projectRoot() ?? '.', 'openapi.json');
  writeFileSync(file, await generateOpenApi());
  console.log(`written: ${file}`);
}
