import type { Result } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { KEY_BYTES } from './crypto/aes-gcm.js';
import { KeyRing, type KeyType } from './crypto/key-ring.js';
import { KeyfleetError, keyNotFound } from './errors.js';
import type { MasterKey } from './master-key.js';
import type { Redis, RedisKeys } from './redis.js';
import type { KeyInfo, KeyList, KeyPolicyPatch } from './schemas.js';

// Each script touches the key's hash and, to make or delete a key, its tenant's index (a sorted
// set of names, for listing); both sit under the one hash-tagged prefix, so the scripts run
// unchanged on Redis Cluster.
// Fields: type, conv, latest, minDec, createdAt, del (deletion allowed), arp (auto-rotate
// period, s), id (this making of the key: one deleted and made again under its name has
// another; keys made before it was kept have none), m:{n} wrapped material, c:{n} version
// creation (ms), n:{n} encryptions. A script that changes what a process caches (KeyCache)
// publishes the key's Redis name on the key-changes channel, its last ARGV, in the same step:
// every process forgets its copy at once (key-changes.ts), not when its KEY_CACHE_TTL_MS ends.
const CREATE = `
local t = redis.call('HGET', KEYS[1], 'type')
if t then return t .. ':' .. (redis.call('HGET', KEYS[1], 'conv') or '0') end
redis.call('HSET', KEYS[1], 'type', ARGV[1], 'conv', ARGV[2], 'latest', 1, 'minDec', 1, 'minEnc', 1, 'createdAt', ARGV[3], 'm:1', ARGV[4], 'c:1', ARGV[5], 'del', 0, 'arp', 0, 'id', ARGV[6])
redis.call('ZADD', KEYS[2], 0, ARGV[8])
redis.call('PUBLISH', ARGV[7], KEYS[1])
return ''`;

// Lists a key made by an API from before the index (indexAll): only while its hash exists, so a
// key deleted since it was scanned is not listed again.
const INDEX = `
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('ZADD', KEYS[2], 'NX', 0, ARGV[1])`;

// Drops a listed name whose key is gone (deleted by an API from before the index): only while
// its hash is missing, so a key made again under the name since it was read stays listed.
const UNINDEX = `
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
return redis.call('ZREM', KEYS[2], ARGV[1])`;

// Counts encryptions only into the making of the key that made them: a count that arrives
// after the key was deleted would otherwise leave a hash of its own, which a key made later
// under the name would take over as its budget. -1: that key is gone.
const COUNT = `
local f = redis.call('HMGET', KEYS[1], 'type', 'id')
if not f[1] or (f[2] or '') ~= ARGV[1] then return -1 end
return redis.call('HINCRBY', KEYS[1], ARGV[2], ARGV[3])`;

// Optimistic: the new version's material is wrapped (bound to its version) before the script
// runs; if another rotation won the race, the script refuses and the caller retries.
const ROTATE = `
local l = redis.call('HGET', KEYS[1], 'latest')
if not l then return -1 end
if l ~= ARGV[1] then return -2 end
local n = tonumber(l) + 1
redis.call('HSET', KEYS[1], 'latest', n, 'm:' .. n, ARGV[2], 'c:' .. n, ARGV[3])
redis.call('PUBLISH', ARGV[4], KEYS[1])
return n`;

// Policy changes in one script: ARGV minDec, del, arp, minEnc ('' = unchanged). Both versions
// are checked before anything is written: a refused patch changes nothing. A version whose
// material was trimmed (trim removes 1..n-1, so every version from one that exists on does too)
// can be neither: minDec may not come back down over deleted material.
const PATCH = `
local l = redis.call('HGET', KEYS[1], 'latest')
if not l then return -1 end
for _, arg in ipairs({ ARGV[1], ARGV[4] }) do
  if arg ~= '' then
    if tonumber(arg) < 1 or tonumber(arg) > tonumber(l) then return -2 end
    if redis.call('HEXISTS', KEYS[1], 'm:' .. arg) == 0 then return -3 end
  end
end
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], 'minDec', ARGV[1]) end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'minEnc', ARGV[4]) end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'del', ARGV[2]) end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'arp', ARGV[3]) end
redis.call('PUBLISH', ARGV[5], KEYS[1])
return 1`;

// Removes the material of versions below ARGV[1], which must not be above minDec, and raises
// minEnc to it where it was lower: a minimum never names a version whose material is gone.
const TRIM = `
local minDec = redis.call('HGET', KEYS[1], 'minDec')
if not minDec then return -1 end
local below = tonumber(ARGV[1])
if below < 1 or below > tonumber(minDec) then return -2 end
if tonumber(redis.call('HGET', KEYS[1], 'minEnc') or '1') < below then redis.call('HSET', KEYS[1], 'minEnc', below) end
local removed = 0
for v = 1, below - 1 do removed = removed + redis.call('HDEL', KEYS[1], 'm:' .. v, 'c:' .. v, 'n:' .. v) end
redis.call('PUBLISH', ARGV[2], KEYS[1])
return removed`;

// Replaces one wrapped version only if it is still what was read (a rotation may race).
const REWRAP = `
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1`;

const DELETE = `
local del = redis.call('HGET', KEYS[1], 'del')
if not del then return -1 end
if del ~= '1' then return -2 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('PUBLISH', ARGV[1], KEYS[1])
return 1`;

declare module 'ioredis' {
  interface RedisCommander<Context> {
    kfKeyCreate(key: string, index: string, type: string, convergent: string, createdAt: string, wrapped: string, createdMs: number, id: string, changes: string, name: string): Result<string, Context>;
    kfKeyIndex(key: string, index: string, name: string): Result<number, Context>;
    kfKeyUnindex(key: string, index: string, name: string): Result<number, Context>;
    kfKeyCount(key: string, id: string, field: string, count: number): Result<number, Context>;
    kfKeyRotate(key: string, expectedLatest: string, wrapped: string, createdMs: number, changes: string): Result<number, Context>;
    kfKeyPatch(key: string, minDec: string, deletionAllowed: string, autoRotatePeriod: string, minEnc: string, changes: string): Result<number, Context>;
    kfKeyTrim(key: string, minAvailableVersion: number, changes: string): Result<number, Context>;
    kfKeyDelete(key: string, index: string, changes: string, name: string): Result<number, Context>;
    kfKeyRewrap(key: string, field: string, expected: string, wrapped: string): Result<number, Context>;
  }
}

export interface CreateKeyOptions {
  readonly type: KeyType;
  readonly convergent?: boolean;
  /** Imported material (legacy keys only); otherwise fresh random bytes. */
  readonly material?: Buffer;
}

/** A loaded key: its ring, and what the encrypt path checks before using it. */
export interface LoadedKey {
  readonly ring: KeyRing;
  /** Encryptions counted under each version (nonce budget); a version never counted is absent. */
  readonly encryptions: ReadonlyMap<number, number>;
  /** When the latest version was made (ms since the epoch). */
  readonly latestCreatedMs: number;
  /** Rotate after this many seconds (0: never). */
  readonly autoRotatePeriod: number;
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
    redis.defineCommand('kfKeyCreate', { numberOfKeys: 2, lua: CREATE });
    redis.defineCommand('kfKeyIndex', { numberOfKeys: 2, lua: INDEX });
    redis.defineCommand('kfKeyUnindex', { numberOfKeys: 2, lua: UNINDEX });
    redis.defineCommand('kfKeyRotate', { numberOfKeys: 1, lua: ROTATE });
    redis.defineCommand('kfKeyPatch', { numberOfKeys: 1, lua: PATCH });
    redis.defineCommand('kfKeyTrim', { numberOfKeys: 1, lua: TRIM });
    redis.defineCommand('kfKeyDelete', { numberOfKeys: 2, lua: DELETE });
    redis.defineCommand('kfKeyCount', { numberOfKeys: 1, lua: COUNT });
    redis.defineCommand('kfKeyRewrap', { numberOfKeys: 1, lua: REWRAP });
  }

  /** Creates the key with version 1; `created: false` when it already existed alike. Another type or convergence is a 409. */
  async create(tenant: string, name: string, { type, convergent = false, material }: CreateKeyOptions): Promise<{ info: KeyInfo; created: boolean }> {
    const wrapped = this.#master.wrap(material ?? randomBytes(KEY_BYTES), tenant, name, 1);
    const now = new Date();
    const existing = await this.#redis.kfKeyCreate(this.#keys.key(tenant, name), this.#keys.keyIndex(tenant), type, convergent ? '1' : '0', now.toISOString(), wrapped, now.getTime(), randomBytes(8).toString('hex'), this.#keys.keyChanges, name);
    if (existing !== '' && existing !== `${type}:${convergent ? '1' : '0'}`) {
      const [otherType, otherConv] = existing.split(':');
      throw new KeyfleetError('KF_KEY_EXISTS', `a key of that name exists with type ${otherType}${otherConv === '1' ? ', convergent' : ''}`);
    }
    // An import never replaces material: importing into an existing key is refused above or a no-op only for fresh keys.
    if (existing !== '' && material) throw new KeyfleetError('KF_KEY_EXISTS', 'a key of that name exists; imported material is never replaced');
    return { info: await this.info(tenant, name), created: existing === '' };
  }

  async info(tenant: string, name: string): Promise<KeyInfo> {
    const info = await this.#read(tenant, name);
    if (!info) throw keyNotFound(name);
    return info;
  }

  /**
   * A tenant's keys in name order, the first `limit` after `after`; `next` (the last name read)
   * when more follow. A name whose key is gone is left out, and dropped from the index.
   */
  async list(tenant: string, { after, limit }: { after?: string | undefined; limit: number }): Promise<KeyList> {
    const index = this.#keys.keyIndex(tenant);
    const names = await this.#redis.zrangebylex(index, after === undefined ? '-' : `(${after}`, '+', 'LIMIT', 0, limit + 1);
    const page = names.slice(0, limit);
    const read = await Promise.all(page.map((name) => this.#read(tenant, name)));
    const gone = page.filter((_name, i) => read[i] === undefined);
    await Promise.all(gone.map((name) => this.#redis.kfKeyUnindex(this.#keys.key(tenant, name), index, name)));
    const keys = read.filter((info) => info !== undefined);
    return names.length > limit ? { keys, next: page.at(-1)! } : { keys };
  }

  /**
   * Lists every key in its tenant's index: keys made by an API from before the index was kept
   * are in none. The API runs it at each start; keys already listed are left alone, so it is
   * safe beside APIs still running, old or new (what an old API makes after the scan waits for
   * the next start; what it deletes, `list` drops). `signal` stops it between scanned pages.
   */
  async indexAll(signal?: AbortSignal): Promise<{ keys: number; indexed: number }> {
    const counts = { keys: 0, indexed: 0 };
    for await (const batch of this.#scanKeys()) {
      if (signal?.aborted) break;
      const added = await Promise.all(batch.map(({ redisKey, tenant, name }) => this.#redis.kfKeyIndex(redisKey, this.#keys.keyIndex(tenant), name)));
      counts.keys += batch.length;
      counts.indexed += added.reduce((sum, n) => sum + n, 0);
    }
    return counts;
  }

  async #read(tenant: string, name: string): Promise<KeyInfo | undefined> {
    const [type, conv, latest, minDec, createdAt, del, arp, minEnc] = await this.#redis.hmget(this.#keys.key(tenant, name), 'type', 'conv', 'latest', 'minDec', 'createdAt', 'del', 'arp', 'minEnc');
    if (!type || !latest || !minDec || !createdAt) return undefined;
    return {
      name,
      type: type as KeyType,
      convergent: conv === '1',
      latestVersion: Number(latest),
      minDecryptionVersion: Number(minDec),
      minEncryptionVersion: Number(minEnc ?? 1),
      deletionAllowed: del === '1',
      autoRotatePeriod: Number(arp ?? 0),
      createdAt,
    };
  }

  /** Every key's hash, a scanned page at a time, on each master (all of them sit on one under the hash tag). */
  async *#scanKeys(): AsyncGenerator<Array<{ redisKey: string; tenant: string; name: string }>> {
    const head = this.#keys.key('', '').slice(0, -1); // `${prefix}:key:`
    const nodes = 'nodes' in this.#redis ? this.#redis.nodes('master') : [this.#redis];
    for (const node of nodes) {
      for await (const batch of node.scanStream({ match: `${head}*`, count: 500 }) as AsyncIterable<string[]>) {
        yield batch.flatMap((redisKey) => {
          const key = this.#keys.keyOf(redisKey);
          return key ? [{ redisKey, ...key }] : [];
        });
      }
    }
  }

  /** Adds a version. With `ifLatest`, only if the latest is still that version (automatic rotations race). */
  async rotate(tenant: string, name: string, ifLatest?: number): Promise<KeyInfo> {
    for (let attempt = 0; attempt < 5; attempt++) {
      const { latestVersion, type } = await this.info(tenant, name);
      if (type === 'legacy-aes256-cbc') throw new KeyfleetError('KF_KEY_OPERATION_UNSUPPORTED', 'a legacy key holds imported material only; it is not rotated');
      if (ifLatest !== undefined && latestVersion !== ifLatest) return this.info(tenant, name);
      const wrapped = this.#master.wrap(randomBytes(KEY_BYTES), tenant, name, latestVersion + 1);
      const result = await this.#redis.kfKeyRotate(this.#keys.key(tenant, name), String(latestVersion), wrapped, Date.now(), this.#keys.keyChanges);
      if (result === -1) throw keyNotFound(name);
      if (result > 0) return this.info(tenant, name);
    }
    throw new KeyfleetError('KF_KEY_CONFLICT');
  }

  async patch(tenant: string, name: string, patch: KeyPolicyPatch): Promise<KeyInfo> {
    const arg = (v: number | boolean | undefined) => (v === undefined ? '' : typeof v === 'boolean' ? (v ? '1' : '0') : String(v));
    const result = await this.#redis.kfKeyPatch(this.#keys.key(tenant, name), arg(patch.minDecryptionVersion), arg(patch.deletionAllowed), arg(patch.autoRotatePeriod), arg(patch.minEncryptionVersion), this.#keys.keyChanges);
    if (result === -1) throw keyNotFound(name);
    if (result === -2) throw new KeyfleetError('KF_KEY_VERSION_INVALID');
    if (result === -3) throw new KeyfleetError('KF_KEY_VERSION_INVALID', 'that version was trimmed: its material is gone');
    return this.info(tenant, name);
  }

  /** Deletes the material of versions below `minAvailableVersion` (at most minDecryptionVersion): those ciphertexts are gone for good. */
  async trim(tenant: string, name: string, minAvailableVersion: number): Promise<KeyInfo> {
    const result = await this.#redis.kfKeyTrim(this.#keys.key(tenant, name), minAvailableVersion, this.#keys.keyChanges);
    if (result === -1) throw keyNotFound(name);
    if (result === -2) throw new KeyfleetError('KF_KEY_VERSION_INVALID', 'minAvailableVersion must be between 1 and minDecryptionVersion');
    return this.info(tenant, name);
  }

  /** Deletes a key that was marked `deletionAllowed`. */
  async delete(tenant: string, name: string): Promise<void> {
    const result = await this.#redis.kfKeyDelete(this.#keys.key(tenant, name), this.#keys.keyIndex(tenant), this.#keys.keyChanges, name);
    if (result === -1) throw keyNotFound(name);
    if (result === -2) throw new KeyfleetError('KF_KEY_DELETION_NOT_ALLOWED');
  }

  /**
   * Master-key rotation: rewraps every version of every key that is not under the current
   * master key yet (it must be unwrappable: current or KEYFLEET_MASTER_KEY_PREVIOUS). Safe to run
   * while the service runs, and again: values already current are left alone.
   */
  async rewrapAll(): Promise<{ keys: number; versions: number; rewrapped: number }> {
    const counts = { keys: 0, versions: 0, rewrapped: 0 };
    for await (const batch of this.#scanKeys()) {
      for (const { redisKey, tenant, name } of batch) {
        const fields = await this.#redis.hgetall(redisKey);
        counts.keys++;
        for (const [field, wrapped] of Object.entries(fields)) {
          if (!field.startsWith('m:')) continue;
          counts.versions++;
          if (this.#master.isCurrent(wrapped)) continue;
          const version = Number(field.slice(2));
          const material = this.#master.unwrap(wrapped, tenant, name, version);
          counts.rewrapped += await this.#redis.kfKeyRewrap(redisKey, field, wrapped, this.#master.wrap(material, tenant, name, version));
          material.fill(0);
        }
      }
    }
    return counts;
  }

  /**
   * Adds `count` encryptions under a version of the key's making `incarnation` (KeyPolicy gathers
   * them first); the new total, or -1 when that key is gone (deleted, perhaps made again).
   */
  countEncryptions(tenant: string, name: string, incarnation: string, version: number, count: number): Promise<number> {
    return this.#redis.kfKeyCount(this.#keys.key(tenant, name), incarnation, `n:${version}`, count);
  }

  /** Loads and unwraps every version of a key; undefined when the key does not exist. */
  async load(tenant: string, name: string): Promise<LoadedKey | undefined> {
    const fields = await this.#redis.hgetall(this.#keys.key(tenant, name));
    if (!fields['type']) return undefined;
    const versions: Array<{ version: number; material: Buffer }> = [];
    const encryptions = new Map<number, number>();
    for (const [field, value] of Object.entries(fields)) {
      if (field.startsWith('n:')) encryptions.set(Number(field.slice(2)), Number(value));
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
    const latest = Number(fields['latest']);
    const ring = new KeyRing({
      name,
      type: fields['type'] as KeyType,
      convergent: fields['conv'] === '1',
      latestVersion: latest,
      minDecryptionVersion: Number(fields['minDec']),
      minEncryptionVersion: Number(fields['minEnc'] ?? 1),
      incarnation: fields['id'] ?? '',
      versions,
    });
    return {
      ring,
      encryptions,
      latestCreatedMs: Number(fields[`c:${latest}`] ?? Date.parse(fields['createdAt'] ?? '')),
      autoRotatePeriod: Number(fields['arp'] ?? 0),
    };
  }
}
