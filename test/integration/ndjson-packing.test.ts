import { Redis } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { afterAll, describe, expect, it, vi } from 'vitest';
import { BatchIntake, canPackLines } from '../../producer/batch-intake.js';
import { readNdjsonItems } from '../../producer/ndjson-items.js';
import { AtRestSealer } from '../../shared/at-rest.js';
import { BatchStore } from '../../shared/batch-store.js';
import { forEachItem, ITEM_NOT_STRING, ITEM_OK, ITEM_TOO_LARGE } from '../../shared/chunk-codec.js';
import { createLogger } from '../../shared/logger.js';
import { createChunkQueue } from '../../shared/queue.js';
import { ConnectionErrorLog, RedisKeys } from '../../shared/redis.js';
import { testEnv } from '../helpers/env.js';
import { seededRandom } from '../helpers/seeded.js';

const { env } = testEnv();
const redis = new Redis(env['REDIS_URL']!);
const keys = new RedisKeys(env['KEYFLEET_PREFIX']!);
const store = new BatchStore(redis, keys, { resultTtlSeconds: 600, uploadIdleSeconds: 60, sealer: new AtRestSealer(randomBytes(32)) });
const queue = createChunkQueue(redis, keys, { attempts: 1, errors: new ConnectionErrorLog(createLogger({ level: 'silent', name: 'test' })) });
afterAll(async () => {
  await queue.close();
  await redis.quit();
});

const MAX_ITEM = 40;
/** Stands for a byte that is not UTF-8 (0xFF) in the lines below, which are JS strings: `bytesOf` puts the byte in. */
const NOT_UTF8 = '\ue000';
const bytesOf = (text: string): Buffer => Buffer.concat(text.split(NOT_UTF8).flatMap((part, i) => (i === 0 ? [Buffer.from(part)] : [Buffer.from([0xff]), Buffer.from(part)])));

/** Lines of every kind the parser tells apart: plain ASCII, non-ASCII, escapes, not strings, blank, padded, CRLF, too long, not UTF-8, lone surrogates. */
function lineOf(rand: () => number): string {
  const pick = Math.floor(rand() * 17);
  const text = Array.from({ length: Math.floor(rand() * 30) }, () => String.fromCharCode(0x21 + Math.floor(rand() * 90))).join('').replace(/["\\]/g, 'x');
  switch (pick) {
    case 0: return '';
    case 1: return `  ${JSON.stringify(text)}\t`;
    case 2: return `${JSON.stringify(text)}\r`;
    case 3: return JSON.stringify(`é${text}€`);
    case 4: return JSON.stringify(`${text}"\\\n`);
    case 5: return String(Math.floor(rand() * 1000));
    case 6: return `"${text}`; // unterminated
    case 7: return JSON.stringify('L'.repeat(MAX_ITEM + 1 + Math.floor(rand() * 10)));
    case 8: return `"\u0001${text}"`; // a raw control character: not JSON
    case 9: return JSON.stringify('é'.repeat(MAX_ITEM)); // 80 bytes: too large
    case 10: return JSON.stringify(`${text}\\\t`); // escapes, no quote
    case 11: return `"\\u0041${text}"`; // a \u escape
    case 12: return `"${text}${NOT_UTF8}"`;
    case 13: return `"\\u0041${text}${NOT_UTF8}"`; // escapes, and a byte that is not UTF-8
    case 14: return `"${text}\\ud800"`; // a lone surrogate
    default: return JSON.stringify(text);
  }
}

/** What each non-blank line should become, from JSON.parse, and whether its bytes are UTF-8 and its text well-formed. */
function expected(lines: readonly string[]): Array<{ flag: number; text?: string }> {
  return lines.filter((l) => l.trim() !== '').map((line) => {
    let value: unknown;
    try {
      value = JSON.parse(line);
    } catch {
      return { flag: ITEM_NOT_STRING };
    }
    if (typeof value !== 'string' || value.includes(NOT_UTF8) || !value.isWellFormed()) return { flag: ITEM_NOT_STRING };
    return Buffer.byteLength(value) > MAX_ITEM ? { flag: ITEM_TOO_LARGE } : { flag: ITEM_OK, text: value };
  });
}

/** Uploads `body` in pieces of the given sizes through a real intake, and reads back every stored chunk. */
async function packed(body: Buffer, cuts: readonly number[], native: boolean, maxItem = MAX_ITEM): Promise<Array<{ flag: number; text?: string }>> {
  const spec = { tenant: 'acme', op: 'encrypt' as const, key: 'k', encoding: 'utf8' as const, chunkItems: 7 };
  const id = await store.create(spec, 1_000);
  const intake = new BatchIntake(id, spec, store, queue, { chunkItems: 7, chunkBytes: 256 * 1024 * 1024, maxItemBytes: maxItem, maxItems: 100_000 });
  async function* pieces(): AsyncGenerator<Buffer> {
    let at = 0;
    for (const cut of cuts) {
      yield body.subarray(at, Math.min(body.length, at + cut));
      at += cut;
    }
    if (at < body.length) yield body.subarray(at);
  }
  await readNdjsonItems(pieces(), intake, maxItem * 6 + 2, { native });
  await intake.finish();
  const out: Array<{ flag: number; text?: string }> = [];
  const chunks = Math.ceil(intake.total / 7);
  for (let chunk = 0; chunk < chunks; chunk++) {
    forEachItem((await store.readInput(id, 'acme', chunk))!, (flag, bytes) => out.push(flag === ITEM_OK ? { flag, text: bytes.toString('utf8') } : { flag }));
  }
  return out;
}

describe('NDJSON upload packing', () => {
  it.runIf(canPackLines)('packs the same items natively as in JavaScript, and as JSON.parse reads them (failing what is not UTF-8 or well-formed text), however the body is cut', async () => {
    for (let seed = 1; seed <= 40; seed++) {
      const rand = seededRandom(seed);
      const lines = Array.from({ length: 20 + Math.floor(rand() * 60) }, () => lineOf(rand));
      const body = bytesOf(lines.join('\n') + (rand() < 0.5 ? '\n' : ''));
      const cuts = Array.from({ length: 30 }, () => 1 + Math.floor(rand() * 120));
      const want = expected(lines);
      expect(await packed(body, cuts, true), `seed ${seed}`).toEqual(want);
      expect(await packed(body, cuts, false), `seed ${seed}`).toEqual(want);
    }
  });

  it('reads a body that starts with a byte order mark (a file saved by a Windows tool) as one without it, however its first bytes are cut', async () => {
    const lines = ['"LIC-0001"', '"LIC-0002"', '"ünïcødé"'];
    const body = Buffer.concat([Buffer.from([0xef, 0xbb, 0xbf]), Buffer.from(lines.join('\n') + '\n')]);
    for (const cuts of [[1, 1, 1], [2, 5], [3], [4], [200]]) {
      for (const native of [canPackLines, false]) expect(await packed(body, cuts, native), `cuts ${cuts}`).toEqual(expected(lines));
    }
    // Only at the start: elsewhere the bytes are part of a line, which is not a JSON string.
    const inside = Buffer.concat([Buffer.from('"a"\n'), Buffer.from([0xef, 0xbb, 0xbf]), Buffer.from('"b"\n')]);
    expect((await packed(inside, [100], false)).map((i) => i.flag)).toEqual([ITEM_OK, ITEM_NOT_STRING]);
  });

  it('stores every chunk intact when one body piece fills many chunks before any is written', async () => {
    // The intake seals chunks into buffers it reuses once their writes are done: a piece of
    // 300 lines seals ~40 chunks before the first write, and each must keep its own buffer.
    const rand = seededRandom(7);
    const lines = Array.from({ length: 300 }, () => lineOf(rand));
    const body = bytesOf(lines.join('\n') + '\n');
    const want = expected(lines);
    for (const native of canPackLines ? [true, false] : [false]) {
      expect(await packed(body, [], native), `native ${native}`).toEqual(want);
      expect(await packed(body, [], native), `native ${native}, again`).toEqual(want);
    }
  });

  it('copies a line that spans many body pieces once, and drops one over the limit as soon as it passes it', async () => {
    // Counted, not timed: the bytes Buffer.concat copies. A line was joined again with every
    // piece, so that a 60 MB line in 64 KB pieces took 19 s of CPU.
    const maxItem = 64 * 1024;
    const long = 'L'.repeat(maxItem);
    const body = Buffer.from(`"a"\n${JSON.stringify(long)}\n"b"\n"${'x'.repeat(maxItem * 6 + 1)}"\n"c"\n`);
    // Only the reader's own: the Redis client joins what it writes and reads with it too.
    const join = Buffer.concat.bind(Buffer);
    let copied = 0;
    const concat = vi.spyOn(Buffer, 'concat').mockImplementation((list, totalLength) => {
      const joined = join(list, totalLength);
      if (new Error().stack?.includes('ndjson-items')) copied += joined.length;
      return joined;
    });
    try {
      const items = await packed(body, Array(Math.ceil(body.length / 100)).fill(100), false, maxItem);
      expect(items).toEqual([{ flag: ITEM_OK, text: 'a' }, { flag: ITEM_OK, text: long }, { flag: ITEM_OK, text: 'b' }, { flag: ITEM_TOO_LARGE }, { flag: ITEM_OK, text: 'c' }]);
      // The long line once, with its quotes; the one over the limit, six times its size, never.
      expect(copied).toBe(long.length + 2);
    } finally {
      concat.mockRestore();
    }
  });
});
