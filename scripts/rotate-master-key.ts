// Rewraps every key's material under KEYFLEET_MASTER_KEY, unwrapping with it or with
// KEYFLEET_MASTER_KEY_PREVIOUS. Run it once every API and worker accepts both (SECURITY.md).
import { ConfigError, loadConfig, requireMasterKey, type Config } from '../shared/config.js';
import { KeyStore } from '../shared/key-store.js';
import { MasterKey } from '../shared/master-key.js';
import { createRedis, RedisKeys } from '../shared/redis.js';

/**
 * The configuration and master key, or a plain line naming each bad variable (a ConfigError
 * never shows a secret's value) and exit 1: a person runs this tool, and it reports on plain
 * lines, not the services' JSON log lines.
 */
function configured(): { config: Config; masterKey: Buffer } {
  try {
    const config = loadConfig();
    return { config, masterKey: requireMasterKey(config) };
  } catch (err) {
    if (!(err instanceof ConfigError)) throw err;
    console.error(`rotate-master-key: ${err.message}`);
    process.exit(1);
  }
}

const { config, masterKey } = configured();
if (!config.previousMasterKey) {
  console.error('rotate-master-key: set KEYFLEET_MASTER_KEY to the new key and KEYFLEET_MASTER_KEY_PREVIOUS to the old one');
  process.exit(1);
}
const redis = createRedis(config, { role: 'tool', errors: null });
let connectionError: Error | undefined;
redis.on('error', (err: Error) => (connectionError = err));
redis.on('ready', () => (connectionError = undefined));
try {
  const store = new KeyStore(redis, new RedisKeys(config.prefix), new MasterKey(masterKey, config.previousMasterKey));
  const { keys, versions, rewrapped } = await store.rewrapAll();
  console.log(`rotate-master-key: ${keys} keys, ${versions} versions, ${rewrapped} rewrapped under the new master key`);
} catch (err) {
  // Keys already rewrapped stay so (each is written whole); running it again finishes the rest.
  const reason = connectionError ? `cannot reach Redis (${connectionError.message})` : (err as Error).message;
  console.error(`rotate-master-key: stopped: ${reason}`);
  process.exitCode = 1;
} finally {
  redis.disconnect();
}
