import type { FastifyInstance } from 'fastify';
import { Redis } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { BatchIntake } from '../../producer/batch-intake.js';
import { readJsonItems } from '../../producer/json-items.js';
import { AtRestSealer } from '../../shared/at-rest.js';
import { BatchStore } from '../../shared/batch-store.js';
import { forEachItem, ITEM_NOT_STRING, ITEM_OK, ITEM_TOO_LARGE } from '../../shared/chunk-codec.js';
import { createLogger } from '../../shared/logger.js';
import { createChunkQueue } from '../../shared/queue.js';
import { ConnectionErrorLog, RedisKeys } from '../../shared/redis.js';
import { call, TestApis } from '../helpers/apps.js';
import { Client } from '../helpers/client.js';
import { testEnv } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';
import { seededRandom } from '../helpers/seeded.js';

const MAX_ITEM = 1024;
/** What the route gives the JSON reader as its element limit: an item's bytes, each escaped as \u00XX, and its quotes. */
const MAX_ELEMENT = MAX_ITEM * 6 + 2;
const { env, admin } = testEnv({ MAX_ITEM_BYTES: String(MAX_ITEM) });
const apis = new TestApis();
// The reader's own tests use an intake on another prefix: no worker takes their chunks.
const keys = new RedisKeys(testEnv().env['KEYFLEET_PREFIX']!);
const redis = new Redis(env['REDIS_URL']!);
const store = new BatchStore(redis, keys, { resultTtlSeconds: 600, uploadIdleSeconds: 60, sealer: new AtRestSealer(randomBytes(32)) });
const queue = createChunkQueue(redis, keys, { attempts: 1, errors: new ConnectionErrorLog(createLogger({ level: 'silent', name: 'test' })) });
let app: FastifyInstance;
let limited: FastifyInstance;
let client: Client;
let worker: RunningProcess | undefined;

beforeAll(async () => {
  app = await apis.start(env);
  client = new Client(await app.listen({ host: '127.0.0.1', port: 0 }), admin.token);
  limited = await apis.start({ ...env, MAX_BATCH_ITEMS: '3' });
  expect((await client.json('POST', '/v1/keys/k')).status).toBe(201);
  worker = await startWorker(env);
});

afterAll(async () => {
  await worker?.stop();
  await apis.close();
  await queue.close();
  await redis.quit();
});

const MB = 1024 * 1024;
const upload = (app: FastifyInstance, payload: string | Buffer, type = 'application/json') =>
  call(app, admin, 'POST', '/v1/batches?op=encrypt&key=k', payload, { 'content-type': type });

describe('JSON batch upload limits', () => {
  it('answers 413 KF_BATCH_TOO_LARGE for a JSON upload over MAX_BATCH_ITEMS, as NDJSON and mode "async" do', async () => {
    const five = ['a', 'b', 'c', 'd', 'e'];
    const answers = [
      await upload(limited, JSON.stringify({ items: five })),
      await upload(limited, five.map((s) => JSON.stringify(s)).join('\n'), 'application/x-ndjson'),
      await call(limited, admin, 'POST', '/v1/encrypt/k', { items: five, mode: 'async' }),
      // The fourth item is one too large to hold: it still counts.
      await upload(limited, `{"items":["a","b","c","${'A'.repeat(2 * MB)}"]}`),
    ];
    for (const res of answers) {
      expect(res.statusCode).toBe(413);
      expect(res.json().error.code).toBe('KF_BATCH_TOO_LARGE');
    }
    expect((await upload(limited, JSON.stringify({ items: five.slice(0, 3) }))).statusCode).toBe(202);
  });

  it('fails an element of several MB alone as KF_ITEM_TOO_LARGE, in its place, and encrypts the others', async () => {
    const atLimit = '"'.repeat(MAX_ITEM); // 2 × MAX_ITEM bytes of JSON escapes, MAX_ITEM bytes of item
    const body = Buffer.from(
      `{"items": ["first", "${'A'.repeat(8 * MB)}", ${JSON.stringify(atLimit)}, ` +
        `[${Array.from({ length: 400_000 }, () => '"nested"').join(',')}], {"a": "${'B'.repeat(3 * MB)}"}, ` +
        `${'9'.repeat(2 * MB)}, 7, ${JSON.stringify('x'.repeat(MAX_ITEM + 1))}, "last"]}`,
    );
    const res = await fetch(`${client.base}/v1/batches?op=encrypt&key=k`, { method: 'POST', headers: { authorization: `Bearer ${admin.token}`, 'content-type': 'application/json' }, body });
    expect(res.status).toBe(202);
    const { batchId, total } = (await res.json()) as { batchId: string; total: number };
    expect(total).toBe(9);
    expect(await client.waitForBatch(batchId)).toMatchObject({ status: 'completed', succeeded: 3, failed: 6 });
    const lines = await client.results(batchId);
    expect(lines.map((l) => (l.ciphertext ? 'ok' : l.error?.code))).toEqual([
      'ok', 'KF_ITEM_TOO_LARGE', 'ok', 'KF_ITEM_TOO_LARGE', 'KF_ITEM_TOO_LARGE', 'KF_ITEM_TOO_LARGE', 'KF_INVALID_ITEM', 'KF_ITEM_TOO_LARGE', 'ok',
    ]);
    const back = await client.json('POST', '/v1/decrypt/k', { items: lines.filter((l) => l.ciphertext).map((l) => l.ciphertext) });
    expect(back.body.results.map((r: { plaintext: string }) => r.plaintext)).toEqual(['first', atLimit, 'last']);
  });

  it('gives up an oversized element while it is still arriving, instead of holding all of it', async () => {
    // Streamed in 64 KiB pieces: the element is failed once it passes the limit, long before
    // its end arrives (holding it whole is what let one upload grow the API by the body's size).
    const piece = Buffer.alloc(64 * 1024, 'A');
    for (const [open, fill, close] of [['"', piece, '"'], ['[', Buffer.from(`"${'A'.repeat(60)}",`.repeat(1000)), '"end"]']] as const) {
      const intake = await newIntake();
      let totalAtEnd = -1;
      async function* body(): AsyncGenerator<Buffer> {
        yield Buffer.from(`{"items":["first",${open}`);
        for (let i = 0; i < 160; i++) yield fill; // ~10 MB
        totalAtEnd = intake.total;
        yield Buffer.from(`${close},"last"]}`);
      }
      await readJsonItems(body(), intake, MAX_ELEMENT);
      expect(totalAtEnd, `element opened with ${open}`).toBe(2); // "first" and the failed element, before its end
      expect(await storedItems(intake)).toEqual([{ flag: ITEM_OK, text: 'first' }, { flag: ITEM_TOO_LARGE }, { flag: ITEM_OK, text: 'last' }]);
    }
  });

  it('reads every element as JSON.parse does (failing alone one that is not UTF-8 or well-formed text), however the body is cut', async () => {
    for (let seed = 1; seed <= 30; seed++) {
      const rand = seededRandom(seed);
      const elements = Array.from({ length: 10 + Math.floor(rand() * 40) }, () => elementOf(rand));
      const ws = () => [' ', '\n', '\t', ''][Math.floor(rand() * 4)]!;
      const key = rand() < 0.3 ? '"\\u0069tems"' : '"items"';
      const body = bytesOf(`${ws()}{${ws()}${key}${ws()}:${ws()}[${ws()}${elements.join(`${ws()},${ws()}`)}${ws()}]${ws()}}${ws()}`);
      const cuts = Array.from({ length: 200 }, () => 1 + Math.floor(rand() * (rand() < 0.5 ? 16 : MAX_ITEM * 3)));
      const intake = await newIntake();
      await readJsonItems(pieces(body, cuts), intake, MAX_ELEMENT);
      expect(await storedItems(intake), `seed ${seed}`).toEqual(elements.map(expected));
    }
  });

  it('fails an element that is not UTF-8 alone, and no character that pieces cut in two, wherever the body is cut', async () => {
    const ok = (text: string) => ({ flag: ITEM_OK, text });
    const bad = { flag: ITEM_NOT_STRING };
    const cases: Array<[string, Array<{ flag: number; text?: string }>]> = [
      [`{"items":["é",${NOT_UTF8}1,"😀"]}`, [ok('é'), bad, ok('😀')]], // the only bad byte, where a piece may start
      [`{"items":["日${NOT_UTF8}",{"a":"${NOT_UTF8}"},"😀",12,"ab${NOT_UTF8}"]}`, [bad, bad, ok('😀'), bad, bad]],
    ];
    for (const [text, want] of cases) {
      const body = bytesOf(text);
      // In pieces of one byte, and in two pieces cut at every byte.
      for (const cuts of [Array(body.length).fill(1), ...Array.from({ length: body.length - 1 }, (_, at) => [at + 1])]) {
        const intake = await newIntake();
        await readJsonItems(pieces(body, cuts), intake, MAX_ELEMENT);
        expect(await storedItems(intake), `${text} cut at ${cuts.length === 1 ? cuts[0] : 'every byte'}`).toEqual(want);
      }
    }
  });

  it('refuses a string longer than any item outside "items" with 413 KF_PAYLOAD_TOO_LARGE, and "items" that is one at its first byte', async () => {
    const key = await upload(app, `{"${'A'.repeat(8 * MB)}":1,"items":["a"]}`);
    expect(key.statusCode).toBe(413);
    expect(key.json().error.code).toBe('KF_PAYLOAD_TOO_LARGE');
    const value = await upload(app, `{"items":"${'A'.repeat(8 * MB)}"}`);
    expect(value.statusCode).toBe(400);
    expect(value.json().error.code).toBe('KF_VALIDATION');
  });

  it('refuses any other body than {"items": [...]} with 400 KF_VALIDATION, as the sync routes refuse unknown fields', async () => {
    const refused: Array<[string, RegExp]> = [
      // An option in the body would be ignored: the batch would run without it.
      ['{"items":["secret"],"context":"tenant=acme"}', /unrecognized key "context".*query string/],
      ['{"bogus":1,"items":["a"]}', /unrecognized key "bogus"/],
      [`{"${'k'.repeat(100)}":1}`, /unrecognized key "k{64}/],
      ['{"items":["a"],"items":["b"]}', /"items" given twice/],
      ['{"items":{"a":["b"]}}', /expected a JSON object \{"items": \[...\]\}/],
      ['["a","b"]', /expected a JSON object/],
      // Not "no items": the items are not an array, or the body no object.
      ...['{"items":"a"}', '{"items":null}', '{"items":5}', '{"items":true}', '"a"', '7', 'null'].map((body): [string, RegExp] => [body, /expected a JSON object \{"items": \[...\]\} with an array of items/]),
      // Nesting outside the items: the parser's cost grows with the square of its depth.
      [`{"x":${'['.repeat(80_000)}${']'.repeat(80_000)},"items":["a"]}`, /unrecognized key "x"/],
      [`{"items":[],${'['.repeat(80_000)}`, /expected a JSON object/],
    ];
    for (const [body, message] of refused) {
      const res = await upload(app, body);
      expect(res.statusCode, body.slice(0, 40)).toBe(400);
      expect(res.json().error).toMatchObject({ code: 'KF_VALIDATION', message: expect.stringMatching(message) });
    }
    // Nesting inside an element is the element's own: it fails alone.
    const nested = await upload(app, `{"items":["a",${'['.repeat(1_000)}${']'.repeat(1_000)},"b"]}`);
    expect(nested.statusCode).toBe(202);
    expect(nested.json().total).toBe(3);
  });

  it('still refuses malformed JSON as a whole with 400 KF_INVALID_JSON', async () => {
    for (const body of ['{"items":["a" "b"]}', '{"items":[{"a" 1}]}', '{"items":["a",', `{"items":["${'A'.repeat(2 * MB)}"`]) {
      const res = await upload(app, body);
      expect(res.statusCode, body.slice(0, 30)).toBe(400);
      expect(res.json().error.code).toBe('KF_INVALID_JSON');
    }
  });
});

const ELEMENT_LIMIT = MAX_ITEM * 6 + 2;
/** Stands for a byte that is not UTF-8 (0xFF) in the elements below, which are JS strings: `bytesOf` puts the byte in. */
const NOT_UTF8 = '\ue000';
const bytesOf = (text: string): Buffer => Buffer.concat(text.split(NOT_UTF8).flatMap((part, i) => (i === 0 ? [Buffer.from(part)] : [Buffer.from([0xff]), Buffer.from(part)])));

/** Elements of every kind: strings plain, escaped, non-ASCII, at and over the limits, not UTF-8, with a lone surrogate; other JSON; nested elements small and large. */
function elementOf(rand: () => number): string {
  const n = Math.floor(rand() * MAX_ITEM * 1.5);
  switch (Math.floor(rand() * 14)) {
    case 0: return JSON.stringify('é€'.repeat(n / 5));
    case 1: return JSON.stringify(`q"\\\n\u0001${'x'.repeat(n)}`);
    case 2: return `"${'\\u00e9'.repeat(n / 4)}\\ud83d\\ude00"`;
    case 3: return String(Math.floor(rand() * 1e6));
    case 4: return ['true', 'false', 'null', '-1.5e3'][Math.floor(rand() * 4)]!;
    case 5: return JSON.stringify({ a: ['}', ']', '"', 'x'.repeat(n * 5)], b: { c: null } });
    case 6: return `[${Array.from({ length: n * 2 }, (_, i) => i).join(', ')}]`;
    case 7: return JSON.stringify('\\'.repeat(n)); // 2 × n bytes of escapes
    case 8: return JSON.stringify('p'.repeat(n * 5));
    case 9: return `"${'é'.repeat(n / 4)}${NOT_UTF8}${'p'.repeat(n / 4)}"`;
    case 10: return `{"a": "${NOT_UTF8}", "b": ${n}}`;
    case 11: return `"${'\\u00e9'.repeat(n / 8)}\\udc00${'q'.repeat(n / 4)}"`; // a lone surrogate
    case 12: return `${NOT_UTF8}${n}`; // not JSON either, but read as an element that is not UTF-8
    default: return JSON.stringify('p'.repeat(n / 10));
  }
}

/** What JSON.parse makes of an element: too large past the element limit or the item limit, not a string (nor UTF-8, nor well-formed text), or its text. */
function expected(element: string): { flag: number; text?: string } {
  if (bytesOf(element).length > ELEMENT_LIMIT) return { flag: ITEM_TOO_LARGE };
  if (element.includes(NOT_UTF8)) return { flag: ITEM_NOT_STRING };
  const value: unknown = JSON.parse(element);
  if (typeof value !== 'string' || !value.isWellFormed()) return { flag: ITEM_NOT_STRING };
  return Buffer.byteLength(value) > MAX_ITEM ? { flag: ITEM_TOO_LARGE } : { flag: ITEM_OK, text: value };
}

async function* pieces(body: Buffer, cuts: readonly number[]): AsyncGenerator<Buffer> {
  let at = 0;
  for (const cut of cuts) {
    if (at >= body.length) return;
    yield body.subarray(at, at + cut);
    at += cut;
  }
  if (at < body.length) yield body.subarray(at);
}

async function newIntake(): Promise<BatchIntake> {
  const spec = { tenant: 'acme', op: 'encrypt' as const, key: 'k', encoding: 'utf8' as const, chunkItems: 5 };
  return new BatchIntake(await store.create(spec, 1_000), spec, store, queue, { chunkItems: 5, chunkBytes: 256 * 1024 * 1024, maxItemBytes: MAX_ITEM, maxItems: 100_000 });
}

/** Finishes the intake's batch and reads back every stored item. */
async function storedItems(intake: BatchIntake): Promise<Array<{ flag: number; text?: string }>> {
  await intake.finish();
  const out: Array<{ flag: number; text?: string }> = [];
  for (let chunk = 0; chunk < Math.ceil(intake.total / 5); chunk++) {
    forEachItem((await store.readInput(intake.batchId, 'acme', chunk))!, (flag, bytes) => out.push(flag === ITEM_OK ? { flag, text: bytes.toString('utf8') } : { flag }));
  }
  return out;
}
