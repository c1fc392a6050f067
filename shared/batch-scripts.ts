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

// Lifetimes. A batch's keys expire, so even a batch nobody reaps disappears in time, but
// RESULT_TTL_SECONDS (`ttl`) starts only when the batch ends (completed, failed, cancelled):
// a batch still queued or running may wait in the queue longer than that. While open, its
// record and done set live `openTtl` from its last news (a stored or a completed chunk), and
// chunk inputs and results `chunkTtl` (longer) from their write. Inputs outlive the record on
// purpose: a chunk's input is its share of the backlog not yet subtracted, so a job whose
// batch is gone subtracts its items by deleting its input, once (the queue keeps jobs for ever).

/** Lua: the batch ended; its record, done set, chunk starts and every chunk's results now stay `ttl`. */
const startResultClock = ({ meta, done, base, ttl }: { meta: string; done: string; base: string; ttl: string }): string => `
redis.call('EXPIRE', ${meta}, ${ttl})
redis.call('EXPIRE', ${done}, ${ttl})
redis.call('EXPIRE', ${base} .. ':starts', ${ttl})
for i = 0, ${storedChunks(base)} - 1 do redis.call('EXPIRE', ${base} .. ':out:' .. i, ${ttl}) end`;

/** Lua, ending a script: completes the batch (KEYS[1]) once it is sealed and every chunk is done, else publishes progress. */
const completeWhenDone = ({ now, channel, ttl, done, base }: { now: string; channel: string; ttl: string; done: string; base: string }): string => `
if redis.call('HGET', KEYS[1], 'sealed') == '1' and tonumber(redis.call('HGET', KEYS[1], 'chunksDone')) == tonumber(redis.call('HGET', KEYS[1], 'chunks')) then
  redis.call('HSET', KEYS[1], 'status', 'completed', 'finishedAt', ${now})
  ${startResultClock({ meta: 'KEYS[1]', done, base, ttl })}
  redis.call('PUBLISH', ${channel}, 'completed')
  return 2
end
redis.call('PUBLISH', ${channel}, 'progress')
return 1`;

/**
 * Lua: a bound on the chunk indices of the batch KEYS[1] (`base`: its meta key). An upload
 * writes a few chunks at once and they may land out of order, so until it is sealed a stored
 * chunk's index can pass the count: the `added` bitmap covers those.
 */
const storedChunks = (base: string): string =>
  `math.max(tonumber(redis.call('HGET', KEYS[1], 'chunks')), redis.call('STRLEN', ${base} .. ':added') * 8)`;

/**
 * Lua: fails the open batch KEYS[1]: its items not yet processed leave the backlog, its inputs
 * are deleted; results already made stay `ttl` like the record.
 */
const failOpenBatch = (a: { backlog: string; upload: string; done: string; code: string; message: string; now: string; channel: string; base: string; ttl: string }): string => `
redis.call('HSET', KEYS[1], 'status', 'failed', 'errorCode', ${a.code}, 'errorMessage', ${a.message}, 'finishedAt', ${a.now})
redis.call('DECRBY', ${a.backlog}, tonumber(redis.call('HGET', KEYS[1], 'total')) - tonumber(redis.call('HGET', KEYS[1], 'processed')))
for i = 0, ${storedChunks(a.base)} - 1 do redis.call('UNLINK', ${a.base} .. ':in:' .. i) end
${startResultClock({ meta: 'KEYS[1]', done: a.done, base: a.base, ttl: a.ttl })}
redis.call('UNLINK', ${a.upload}, ${a.base} .. ':added')
redis.call('PUBLISH', ${a.channel}, 'failed')`;

/**
 * Lua: the batch's record is gone (expired): the chunk's input, if still there, holds its items
 * in the backlog. The chunk starts, which only a download of the record's batch reads, go too.
 */
const dropOrphanInput = ({ input, backlog, count, base }: { input: string; backlog: string; count: string; base: string }): string => `
if redis.call('UNLINK', ${input}) == 1 then redis.call('DECRBY', ${backlog}, ${count}) end
redis.call('UNLINK', ${base} .. ':starts')`;

/**
 * KEYS meta, input, backlog, upload, done, added, starts · ARGV count, leaseMs, openTtl, chunk,
 * start (the chunk's first item, 4 bytes big-endian). The input was SET (EX chunkTtl) just
 * before. A chunk counts once: ioredis sends a command again when the connection broke before
 * its reply, and the script may have run.
 */
const ADD_CHUNK = `
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'running' then redis.call('UNLINK', KEYS[2]) return 0 end
redis.call('PEXPIRE', KEYS[4], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[5], ARGV[3])
redis.call('SETRANGE', KEYS[7], ARGV[4] * 4, ARGV[5])
redis.call('EXPIRE', KEYS[7], ARGV[3])
local again = redis.call('SETBIT', KEYS[6], ARGV[4], 1) == 1
redis.call('EXPIRE', KEYS[6], ARGV[3])
if again then return 1 end
redis.call('HINCRBY', KEYS[1], 'total', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'chunks', 1)
redis.call('INCRBY', KEYS[3], ARGV[1])
return 1`;

/**
 * KEYS meta, input, result, done, backlog, staged · ARGV chunk, count, succeeded, failed, ttl,
 * now, channel, openTtl, chunkTtl, base. The run's results were SET at `staged` just before;
 * the first run of a chunk renames them into place, any other run's are dropped. A batch
 * completes only once every chunk is counted, so a run finishing after that is a rerun, even
 * when a DELETE has taken the done bits since. Redis keeps what a script did before an error:
 * staged results that are not there (their SET refused, or lost in a failover) return -3
 * before anything is marked, and the chunk runs again.
 */
const COMPLETE_CHUNK = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  redis.call('UNLINK', KEYS[6])
  ${dropOrphanInput({ input: 'KEYS[2]', backlog: 'KEYS[5]', count: 'ARGV[2]', base: 'ARGV[10]' })}
  return -1
end
if status == 'cancelled' or status == 'failed' then redis.call('UNLINK', KEYS[6]) return -2 end
if status == 'completed' or redis.call('GETBIT', KEYS[4], ARGV[1]) == 1 then redis.call('UNLINK', KEYS[6]) return 0 end
if redis.call('EXISTS', KEYS[6]) == 0 then return -3 end
redis.call('SETBIT', KEYS[4], ARGV[1], 1)
redis.call('RENAME', KEYS[6], KEYS[3])
redis.call('EXPIRE', KEYS[3], ARGV[9])
redis.call('UNLINK', KEYS[2])
redis.call('HINCRBY', KEYS[1], 'processed', ARGV[2])
redis.call('HINCRBY', KEYS[1], 'succeeded', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'failed', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'chunksDone', 1)
redis.call('DECRBY', KEYS[5], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('EXPIRE', KEYS[4], ARGV[8])
redis.call('EXPIRE', ARGV[10] .. ':starts', ARGV[8])
if status == 'queued' then redis.call('HSET', KEYS[1], 'status', 'running', 'startedAt', ARGV[6]) end
${completeWhenDone({ now: 'ARGV[6]', channel: 'ARGV[7]', ttl: 'ARGV[5]', done: 'KEYS[4]', base: 'ARGV[10]' })}`;

/**
 * KEYS meta, input, done, backlog, upload · ARGV chunk, count, code, message, now, channel,
 * base, ttl. Before a chunk runs, when its batch record or its input is missing: says what
 * became of it, and settles the backlog. 1: the input is there, run it; 0: already counted;
 * -1: the batch is gone (its items leave the backlog, once); -2: the batch ended; 3: the input
 * expired before the chunk ran, so the batch can never complete: it fails.
 */
const SETTLE_CHUNK = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  ${dropOrphanInput({ input: 'KEYS[2]', backlog: 'KEYS[4]', count: 'ARGV[2]', base: 'ARGV[7]' })}
  return -1
end
if status == 'cancelled' or status == 'failed' then return -2 end
if status == 'completed' or redis.call('GETBIT', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
${failOpenBatch({ backlog: 'KEYS[4]', upload: 'KEYS[5]', done: 'KEYS[3]', code: 'ARGV[3]', message: 'ARGV[4]', now: 'ARGV[5]', channel: 'ARGV[6]', base: 'ARGV[7]', ttl: 'ARGV[8]' })}
return 3`;

/** KEYS meta, upload, done · ARGV now, channel, ttl, base. */
const SEAL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if status == 'cancelled' or status == 'failed' then return -2 end
if status == 'completed' then return 2 end
redis.call('HSET', KEYS[1], 'sealed', 1)
redis.call('DEL', KEYS[2])
redis.call('UNLINK', ARGV[4] .. ':added')
${completeWhenDone({ now: 'ARGV[1]', channel: 'ARGV[2]', ttl: 'ARGV[3]', done: 'KEYS[3]', base: 'ARGV[4]' })}`;

/**
 * KEYS meta, backlog, upload, done · ARGV code, message, now, channel, onlyIf, base, ttl.
 * onlyIf: '0' fails the batch while it is open; 'unsealed' only while its upload is not sealed;
 * 'abandoned' only if its upload was abandoned as well (no live upload lease). The inputs not
 * yet run are deleted; results already made stay to their TTL.
 */
const FAIL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' or status == 'cancelled' then return 0 end
if ARGV[5] ~= '0' and redis.call('HGET', KEYS[1], 'sealed') == '1' then return 0 end
if ARGV[5] == 'abandoned' and redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
${failOpenBatch({ backlog: 'KEYS[2]', upload: 'KEYS[3]', done: 'KEYS[4]', code: 'ARGV[1]', message: 'ARGV[2]', now: 'ARGV[3]', channel: 'ARGV[4]', base: 'ARGV[6]', ttl: 'ARGV[7]' })}
return 1`;

/**
 * KEYS meta, done, backlog, upload · ARGV now, channel, base, ttl. Deletes every input and
 * result; the record stays `ttl` from the cancellation (a batch that had ended keeps its clock).
 */
const CANCEL = `
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
local changed = 0
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finishedAt', ARGV[1])
  redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[1], 'total')) - tonumber(redis.call('HGET', KEYS[1], 'processed')))
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  changed = 1
end
redis.call('HSET', KEYS[1], 'deleted', 1)
for i = 0, ${storedChunks('ARGV[3]')} - 1 do
  redis.call('UNLINK', ARGV[3] .. ':in:' .. i, ARGV[3] .. ':out:' .. i)
end
redis.call('UNLINK', KEYS[2], KEYS[4], ARGV[3] .. ':added', ARGV[3] .. ':starts')
redis.call('PUBLISH', ARGV[2], 'cancelled')
return changed`;

/**
 * KEYS tenantBatches, meta, upload, batchIndex · ARGV metaPrefix, limit, openTtl, leaseMs, id,
 * createdMs, indexMax, field, value, …
 * Admission: counts the tenant's batches still queued or running (forgetting ended ones) and
 * creates the new one only below the limit, atomically. Ids are random, so a record already
 * there is this one, created by a run whose reply was lost (ioredis sent the script again).
 * The tenant's index, for listing, keeps the newest indexMax ids in order of creation, each
 * scored by its time in ms or one past the newest when that is later: scores are unique (a
 * listing's cursor) and batches made in one ms, or after the clock stepped back, keep their
 * order. It has no lifetime of its own (a batch's record may outlive any one): ids whose record
 * expired are dropped here, the oldest two at each creation, and as a listing meets them.
 */
const CREATE = `
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
local active = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local status = redis.call('HGET', ARGV[1] .. id, 'status')
  if status == 'queued' or status == 'running' then active = active + 1 else redis.call('SREM', KEYS[1], id) end
end
if active >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], unpack(ARGV, 8))
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('SET', KEYS[3], 1, 'PX', ARGV[4])
redis.call('SADD', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[3])
local newest = redis.call('ZRANGE', KEYS[4], -1, -1, 'WITHSCORES')[2]
redis.call('ZADD', KEYS[4], math.max(tonumber(ARGV[6]), (tonumber(newest) or 0) + 1), ARGV[5])
local over = redis.call('ZCARD', KEYS[4]) - tonumber(ARGV[7])
if over > 0 then redis.call('ZREMRANGEBYRANK', KEYS[4], 0, over - 1) end
for _, old in ipairs(redis.call('ZRANGE', KEYS[4], 0, 1)) do
  if redis.call('EXISTS', ARGV[1] .. old) == 0 then redis.call('ZREM', KEYS[4], old) end
end
return 1`;

declare module 'ioredis' {
  interface RedisCommander<Context> {
    kfBatchCreate(tenantBatches: string, meta: string, upload: string, batchIndex: string, metaPrefix: string, limit: number, openTtl: number, leaseMs: number, id: string, createdMs: number, indexMax: number, ...fields: Array<string | number>): Result<number, Context>;
    kfChunkAdd(meta: string, input: string, backlog: string, upload: string, done: string, added: string, starts: string, count: number, leaseMs: number, openTtl: number, chunk: number, start: Buffer): Result<number, Context>;
    kfChunkComplete(meta: string, input: string, result: string, done: string, backlog: string, staged: string, chunk: number, count: number, succeeded: number, failed: number, ttl: number, now: string, channel: string, openTtl: number, chunkTtl: number, base: string): Result<number, Context>;
    kfChunkSettle(meta: string, input: string, done: string, backlog: string, upload: string, chunk: number, count: number, code: string, message: string, now: string, channel: string, base: string, ttl: number): Result<number, Context>;
    kfBatchSeal(meta: string, upload: string, done: string, now: string, channel: string, ttl: number, base: string): Result<number, Context>;
    kfBatchFail(meta: string, backlog: string, upload: string, done: string, code: string, message: string, now: string, channel: string, onlyIf: '0' | 'unsealed' | 'abandoned', base: string, ttl: number): Result<number, Context>;
    kfBatchCancel(meta: string, done: string, backlog: string, upload: string, now: string, channel: string, base: string, ttl: number): Result<number, Context>;
  }
}

/** Registers the scripts on a connection (idempotent: ioredis keeps one definition per name). */
export function defineBatchScripts(redis: Redis): void {
  redis.defineCommand('kfBatchCreate', { numberOfKeys: 4, lua: CREATE });
  redis.defineCommand('kfChunkAdd', { numberOfKeys: 7, lua: ADD_CHUNK });
  redis.defineCommand('kfChunkComplete', { numberOfKeys: 6, lua: COMPLETE_CHUNK });
  redis.defineCommand('kfChunkSettle', { numberOfKeys: 5, lua: SETTLE_CHUNK });
  redis.defineCommand('kfBatchSeal', { numberOfKeys: 3, lua: SEAL });
  redis.defineCommand('kfBatchFail', { numberOfKeys: 4, lua: FAIL });
  redis.defineCommand('kfBatchCancel', { numberOfKeys: 4, lua: CANCEL });
}
