import type { Result } from 'ioredis';
import type { Redis } from './redis.js';

// The Lua scripts that account batches. All keys of one batch share the `{hash tag}` prefix,
// so each script runs in one cluster slot; where a script builds a key name (ARGV `base`, the
// batch's meta key), the name keeps that prefix. Progress is accounted only here; the `done`
// bitmap makes a chunk count once.
//
// Chunk payloads (inputs, results: up to megabytes) never pass through Lua: copying a
// large argument into the Lua VM costs Redis more CPU than storing it (bench: "Redis CPU per
// million items"). They are written with a plain SET beside the script and moved by RENAME.

/** Lua, ending a script: completes the batch (KEYS[1]) once it is sealed and every chunk is done, else publishes progress. */
const completeWhenDone = ({ now, channel, ttl }: { now: string; channel: string; ttl: string }): string => `
if redis.call('HGET', KEYS[1], 'sealed') == '1' and tonumber(redis.call('HGET', KEYS[1], 'chunksDone')) == tonumber(redis.call('HGET', KEYS[1], 'chunks')) then
  redis.call('HSET', KEYS[1], 'status', 'completed', 'finishedAt', ${now})
  redis.call('EXPIRE', KEYS[1], ${ttl})
  redis.call('PUBLISH', ${channel}, 'completed')
  return 2
end
redis.call('PUBLISH', ${channel}, 'progress')
return 1`;

/** KEYS meta, input, backlog, upload · ARGV count, leaseMs. The input was SET just before. */
const ADD_CHUNK = `
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then redis.call('UNLINK', KEYS[2]) return 0 end
redis.call('PEXPIRE', KEYS[4], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'total', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'chunks', 1)
redis.call('INCRBY', KEYS[3], ARGV[1])
return 1`;

/**
 * KEYS meta, input, result, done, backlog, staged · ARGV chunk, count, succeeded, failed, ttl,
 * now, channel. The run's results were SET at `staged` just before; the first run of a
 * chunk renames them into place, any other run's are dropped.
 */
const COMPLETE_CHUNK = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then redis.call('UNLINK', KEYS[6]) return -1 end
if status == 'cancelled' or status == 'failed' then redis.call('UNLINK', KEYS[6]) return -2 end
if redis.call('SETBIT', KEYS[4], ARGV[1], 1) == 1 then redis.call('UNLINK', KEYS[6]) return 0 end
local ttl = tonumber(ARGV[5])
redis.call('RENAME', KEYS[6], KEYS[3])
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('UNLINK', KEYS[2])
redis.call('HINCRBY', KEYS[1], 'processed', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'succeeded', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'failed', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'chunksDone', 1)
redis.call('DECRBY', KEYS[5], ARGV[2])
redis.call('EXPIRE', KEYS[4], ttl)
if status == 'queued' then redis.call('HSET', KEYS[1], 'status', 'running', 'startedAt', ARGV[6]) end
${completeWhenDone({ now: 'ARGV[6]', channel: 'ARGV[7]', ttl: 'ttl' })}`;

/** KEYS meta, upload · ARGV now, channel, ttl. */
const SEAL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'cancelled' or status == 'failed' then return -2 end
redis.call('HSET', KEYS[1], 'sealed', 1)
redis.call('DEL', KEYS[2])
${completeWhenDone({ now: 'ARGV[1]', channel: 'ARGV[2]', ttl: 'ARGV[3]' })}`;

/**
 * KEYS meta, backlog, upload · ARGV code, message, now, channel, onlyIfAbandoned, base.
 * With onlyIfAbandoned = '1' it fails the batch only if its upload was abandoned: unsealed,
 * no live upload lease. The inputs not yet run are deleted; results already made stay to their TTL.
 */
const FAIL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' or status == 'cancelled' then return 0 end
if ARGV[5] == '1' and (redis.call('HGET', KEYS[1], 'sealed') == '1' or redis.call('EXISTS', KEYS[3]) == 1) then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'errorCode', ARGV[1], 'errorMessage', ARGV[2], 'finishedAt', ARGV[3])
redis.call('DECRBY', KEYS[2], tonumber(redis.call('HGET', KEYS[1], 'total')) - tonumber(redis.call('HGET', KEYS[1], 'processed')))
for i = 0, tonumber(redis.call('HGET', KEYS[1], 'chunks')) - 1 do redis.call('UNLINK', ARGV[6] .. ':in:' .. i) end
redis.call('UNLINK', KEYS[3])
redis.call('PUBLISH', ARGV[4], 'failed')
return 1`;

/** KEYS meta, done, backlog, upload · ARGV now, channel, base. Deletes every input and result. */
const CANCEL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
local changed = 0
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finishedAt', ARGV[1])
  redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[1], 'total')) - tonumber(redis.call('HGET', KEYS[1], 'processed')))
  changed = 1
end
redis.call('HSET', KEYS[1], 'deleted', 1)
for i = 0, tonumber(redis.call('HGET', KEYS[1], 'chunks')) - 1 do
  redis.call('UNLINK', ARGV[3] .. ':in:' .. i, ARGV[3] .. ':out:' .. i)
end
redis.call('UNLINK', KEYS[2], KEYS[4])
redis.call('PUBLISH', ARGV[2], 'cancelled')
return changed`;

/**
 * KEYS tenantBatches, meta, upload · ARGV metaPrefix, limit, ttl, leaseMs, id, field, value, …
 * Admission: counts the tenant's batches still queued or running (forgetting ended ones) and
 * creates the new one only below the limit, atomically.
 */
const CREATE = `
local active = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local status = redis.call('HGET', ARGV[1] .. id, 'status')
  if status == 'queued' or status == 'running' then active = active + 1 else redis.call('SREM', KEYS[1], id) end
end
if active >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], 1, 'PX', ARGV[4])
redis.call('SADD', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1`;

declare module 'ioredis' {
  interface RedisCommander<Context> {
    kfBatchCreate(tenantBatches: string, meta: string, upload: string, metaPrefix: string, limit: number, ttl: number, leaseMs: number, id: string, ...fields: Array<string | number>): Result<number, Context>;
    kfChunkAdd(meta: string, input: string, backlog: string, upload: string, count: number, leaseMs: number): Result<number, Context>;
    kfChunkComplete(meta: string, input: string, result: string, done: string, backlog: string, staged: string, chunk: number, count: number, succeeded: number, failed: number, ttl: number, now: string, channel: string): Result<number, Context>;
    kfBatchSeal(meta: string, upload: string, now: string, channel: string, ttl: number): Result<number, Context>;
    kfBatchFail(meta: string, backlog: string, upload: string, code: string, message: string, now: string, channel: string, onlyIfAbandoned: '0' | '1', base: string): Result<number, Context>;
    kfBatchCancel(meta: string, done: string, backlog: string, upload: string, now: string, channel: string, base: string): Result<number, Context>;
  }
}

/** Registers the scripts on a connection (idempotent: ioredis keeps one definition per name). */
export function defineBatchScripts(redis: Redis): void {
  redis.defineCommand('kfBatchCreate', { numberOfKeys: 3, lua: CREATE });
  redis.defineCommand('kfChunkAdd', { numberOfKeys: 4, lua: ADD_CHUNK });
  redis.defineCommand('kfChunkComplete', { numberOfKeys: 6, lua: COMPLETE_CHUNK });
  redis.defineCommand('kfBatchSeal', { numberOfKeys: 2, lua: SEAL });
  redis.defineCommand('kfBatchFail', { numberOfKeys: 3, lua: FAIL });
  redis.defineCommand('kfBatchCancel', { numberOfKeys: 4, lua: CANCEL });
}
