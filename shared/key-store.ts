import type { Result } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { KEY_BYTES } from './crypto/aes-gcm.js';
import { KeyRing, type KeyType } from './crypto/key-ring.js';
import { KeyfleetError } from './errors.js';
import type { MasterKey } from './master-key.js';
import type { Redis, RedisKeys } from './redis.js';
import type { KeyInfo } from './schemas.js';

// Each script touches one key (the key's hash), so it runs unchanged on Redis Cluster.
const CREATE = `
local t = redis.call('HGET', KEYS[1], 'type')
if t then return t end
redis.call('HSET', KEYS[1], 'type', ARGV[1], 'latest', 1, 'minDec', 1, 'createdAt', ARGV[2], 'm:1', ARGV[3])
return ''`;

// Optimistic: the new version's material is wrapped (bound to its version) before the script
// runs; if another rotation won the race, the script refuses and the caller retries.
const ROTATE = `
local l = redis.call('HGET', KEYS[1], 'latest')
if not l then return -1 end
if l ~= ARGV[1] then return -2 end
local n = tonumber(l) + 1
redis.call('HSET', KEYS[1], 'latest', n, 'm:' .. n, ARGV[2])
return n`;

const SET_MIN_DEC = `
local l = redis.call('HGET', KEYS[1], 'latest')
if not l then return -1 end
local v = tonumber(ARGV[1])
if v < 1 or v > tonumber(l) then return -2 end
redis.call('HSET', KEYS[1], 'minDec', v)
return v`;

declare module 'ioredis' {
  interface RedisCommander<Context> {
    kfKeyCreate(key: string, type: string, createdAt: string, wrapped: string): Result<string, Context>;
    kfKeyRotate(key: string, expectedLatest: string, wrapped: string): Result<number, Context>;
    kfKeySetMinDec(key: string, version: number): Result<number, Context>;
  }
}

/** Named, versioned keys of a tenant, stored in Redis with their material wrapped under the master key. */
export class KeyStore {
  readonly #redis: Redis;
  readonly #keys: RedisKeys;
  readonly #master: MasterKey;

  constructor(redis: Redis, keys: RedisKeys, master: MasterKey) {
    this.#redis = redis;
    this.#keys = keys;
    this.#master = master;
    redis.defineCommand('kfKeyCreate', { numberOfKeys: 1, lua: CREATE });
    redis.defineCommand('kfKeyRotate', { numberOfKeys: 1, lua: ROTATE });
    redis.defineCommand('kfKeySetMinDec', { numberOfKeys: 1, lua: SET_MIN_DEC });
  }

  /** Creates the key with a fresh version 1; `created: false` when it already existed with this type. */
  async create(tenant: string, name: string, type: KeyType): Promise<{ info: KeyInfo; created: boolean }> {
    const wrapped = this.#master.wrap(randomBytes(KEY_BYTES), tenant, name, 1);
    const existing = await this.#redis.kfKeyCreate(this.#keys.key(tenant, name), type, new Date().toISOString(), wrapped);
    if (existing !== '' && existing !== type) throw new KeyfleetError('KF_KEY_EXISTS', `a key of that name exists with type ${existing}`);
    return { info: await this.info(tenant, name), created: existing === '' };
  }

  async info(tenant: string, name: string): Promise<KeyInfo> {
    const [type, latest, minDec, createdAt] = await this.#redis.hmget(this.#keys.key(tenant, name), 'type', 'latest', 'minDec', 'createdAt');
    if (!type || !latest || !minDec || !createdAt) throw new KeyfleetError('KF_KEY_NOT_FOUND');
    return { name, type: type as KeyType, latestVersion: Number(latest), minDecryptionVersion: Number(minDec), createdAt };
  }

  async rotate(tenant: string, name: string): Promise<KeyInfo> {
    for (let attempt = 0; attempt < 5; attempt++) {
      const { latestVersion } = await this.info(tenant, name);
      const wrapped = this.#master.wrap(randomBytes(KEY_BYTES), tenant, name, latestVersion + 1);
      const result = await this.#redis.kfKeyRotate(this.#keys.key(tenant, name), String(latestVersion), wrapped);
      if (result === -1) throw new KeyfleetError('KF_KEY_NOT_FOUND');
      if (result > 0) return this.info(tenant, name);
    }
    throw new KeyfleetError('KF_KEY_CONFLICT');
  }

  async setMinDecryptionVersion(tenant: string, name: string, version: number): Promise<KeyInfo> {
    const result = await this.#redis.kfKeySetMinDec(this.#keys.key(tenant, name), version);
    if (result === -1) throw new KeyfleetError('KF_KEY_NOT_FOUND');
    if (result === -2) throw new KeyfleetError('KF_KEY_VERSION_INVALID');
    return this.info(tenant, name);
  }

  /** Loads and unwraps every version of a key; undefined when the key does not exist. */
  async loadRing(tenant: string, name: string): Promise<KeyRing | undefined> {
    const fields = await this.#redis.hgetall(this.#keys.key(tenant, name));
    if (!fields['type']) return undefined;
    const versions: Array<{ version: number; material: Buffer }> = [];
    for (const [field, value] of Object.entries(fields)) {
      if (!field.startsWith('m:')) continue;
      const version = Number(field.slice(2));
      try {
        versions.push({ version, material: this.#master.unwrap(value, tenant, name, version) });
      } catch (err) {
        // Not the caller's fault and not a secret: the service runs with another master key
        // than the one this key was created under. Say so, to the caller and in the log.
        throw new KeyfleetError('KF_MASTER_KEY_MISMATCH', undefined, { cause: err });
      }
    }
    return new KeyRing({
      name,
      type: fields['type'] as KeyType,
      latestVersion: Number(fields['latest']),
      minDecryptionVersion: Number(fields['minDec']),
      versions,
    });
  }
}
