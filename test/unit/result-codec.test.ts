import { randomBytes } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { ChunkPacker } from '../../shared/chunk-codec.js';
import { resultFormatter, runChunkInto, type KernelChoice } from '../../shared/crypto/kernel.js';
import { KeyRing } from '../../shared/crypto/key-ring.js';
import { NonceSource } from '../../shared/crypto/nonces.js';
import { formatCiphertext } from '../../shared/crypto/format.js';
import { asciiJson, RECORD_CIPHERTEXT, RECORD_ERROR, RECORD_PLAINTEXT_BASE64, RECORD_PLAINTEXT_UTF8, RESULT_ERROR_JSON, RESULT_ERRORS, RESULTS_FORMAT, notProcessedLines, resultLines, ResultWriter } from '../../shared/result-codec.js';
import { CATALOGUE } from '../../shared/errors.js';
import { seededRandom } from '../helpers/seeded.js';

const ring = new KeyRing({ name: 'codec', type: 'aes256-gcm96', latestVersion: 1, minDecryptionVersion: 1, versions: [{ version: 1, material: randomBytes(32) }] });
const nonces = new NonceSource();
const formatters = ['native', 'js'] as const;

function records(op: 'encrypt' | 'decrypt', items: readonly string[], kernel: KernelChoice = 'native'): Buffer {
  const packer = new ChunkPacker();
  for (const item of items) packer.add(Buffer.from(item));
  const out = runChunkInto({ op, encoding: 'utf8', maxItemBytes: 4096 }, packer.take(), ring, 0, kernel, nonces);
  return Buffer.from(out.buffer);
}

const pieces = (stored: Buffer, formatter: KernelChoice, firstIndex: number, skip: number, pieceBytes?: number): Buffer[] =>
  [...resultLines(stored, firstIndex, skip, resultFormatter(formatter), pieceBytes)];
const text = (parts: Buffer[]): string => Buffer.concat(parts).toString('utf8');

describe('stored results', () => {
  it('are records about 60% the size of the lines they become', () => {
    const items = Array.from({ length: 1000 }, (_, i) => `LIC-${String(i).padStart(28, '0')}`);
    const stored = records('encrypt', items);
    expect(stored[0]).toBe(RESULTS_FORMAT);
    const lines = text(pieces(stored, 'native', 0, 0));
    expect(lines.split('\n').filter(Boolean)).toHaveLength(1000);
    expect(stored.length / Buffer.byteLength(lines)).toBeLessThan(0.65);
  });

  it('are the same bytes from both kernels, through chunks that outgrow the writer\'s first buffer', () => {
    const items = Array.from({ length: 5000 }, (_, i) => (i % 3 === 0 ? `serial-${i}` : `ünïcødé ${i} "${'x'.repeat(i % 40)}"`));
    const cts = text(pieces(records('encrypt', items, 'js'), 'js', 0, 0)).split('\n').filter(Boolean).map((l) => JSON.parse(l).ciphertext as string);
    const withBad = cts.map((c, i) => (i % 97 === 0 ? c.slice(0, -4) + 'AAA=' : c));
    const js = records('decrypt', withBad, 'js');
    expect(js.length).toBeGreaterThan(64 * 1024);
    expect(js.equals(records('decrypt', withBad, 'native'))).toBe(true);
    const lines = text(pieces(js, 'native', 0, 0)).split('\n').filter(Boolean).map((l) => JSON.parse(l));
    expect(lines.map((l) => l.plaintext ?? l.error.code)).toEqual(items.map((item, i) => (i % 97 === 0 ? 'KF_DECRYPT_FAILED' : item)));
  });

  for (const formatter of formatters) {
    it(`${formatter}: resume at any item, numbered from the chunk's first index, in pieces of the size asked`, () => {
      const items = Array.from({ length: 50 }, (_, i) => `item ${i} "quoted" ✓`);
      const stored = records('decrypt', text(pieces(records('encrypt', items), formatter, 0, 0)).split('\n').filter(Boolean).map((l) => JSON.parse(l).ciphertext));
      const whole = text(pieces(stored, formatter, 1000, 0)).split('\n').filter(Boolean).map((l) => JSON.parse(l));
      expect(whole.map((l) => l.i)).toEqual(items.map((_, i) => 1000 + i));
      expect(whole.map((l) => l.plaintext)).toEqual(items);
      const parts = pieces(stored, formatter, 1000, 7, 300);
      expect(parts.length).toBeGreaterThan(5);
      expect(text(parts).split('\n').filter(Boolean).map((l) => JSON.parse(l))).toEqual(whole.slice(7));
      expect(pieces(stored, formatter, 1000, 50)).toEqual([]);
    });
  }

  it('a line longer than a piece gets a piece of its own, the same bytes from both formatters', () => {
    const big = '"\\\u0001'.repeat(1000); // 3,000 bytes that JSON escapes to 10,000
    const stored = records('decrypt', [records('encrypt', ['small', big, 'after'], 'native')].flatMap((r) => text(pieces(r, 'js', 0, 0)).split('\n').filter(Boolean).map((l) => JSON.parse(l).ciphertext)));
    const native = pieces(stored, 'native', 0, 0, 256);
    expect(native.some((p) => p.length > 10_000)).toBe(true);
    expect(text(native)).toBe(text(pieces(stored, 'js', 0, 0, 256)));
    expect(text(native).split('\n').filter(Boolean).map((l) => JSON.parse(l).plaintext)).toEqual(['small', big, 'after']);
  });

  it('random records of every kind: the same bytes from both formatters, each line the JSON expected', () => {
    // Seeded, so a failure names a seed that reproduces it.
    for (const seed of [1, 2, 3]) {
      const next = seededRandom(seed);
      const rand = (n: number): number => Math.floor(next() * n);
      const bytes = (n: number) => Buffer.from(Array.from({ length: n }, () => rand(256)));
      // Every ASCII character (controls, quote, backslash, DEL) and some beyond, two of them astral.
      const alphabet = [...Array.from({ length: 128 }, (_, c) => String.fromCharCode(c)), 'é', '✓', '\u2028', '\u2029', '\uFFFD', '😀', '𝄞'];
      const writer = new ResultWriter();
      const expected: object[] = [];
      const firstIndex = 4_000_000_000;
      for (let n = 0; n < 1500; n++) {
        const i = firstIndex + n;
        switch (rand(4)) {
          case RECORD_CIPHERTEXT: {
            const version = [1, 2, 255, 65_536, 2 ** 32 - 1][rand(5)]!;
            const sealed = bytes(rand(90));
            writer.ciphertext(version, sealed);
            expected.push({ i, ciphertext: formatCiphertext(version, sealed) });
            break;
          }
          case RECORD_PLAINTEXT_UTF8: {
            const plaintext = Array.from({ length: rand(40) }, () => alphabet[rand(alphabet.length)]).join('');
            writer.plaintext(Buffer.from(plaintext), RECORD_PLAINTEXT_UTF8);
            expected.push({ i, plaintext });
            break;
          }
          case RECORD_PLAINTEXT_BASE64: {
            const plain = bytes(rand(40));
            writer.plaintext(plain, RECORD_PLAINTEXT_BASE64);
            expected.push({ i, plaintext: plain.toString('base64') });
            break;
          }
          default: {
            const code = RESULT_ERRORS[rand(RESULT_ERRORS.length)]!;
            writer.error(code);
            expected.push({ i, error: { code, message: CATALOGUE[code].message } });
          }
        }
      }
      const stored = Buffer.from(writer.bytes);
      const skip = rand(100);
      const pieceBytes = 1024 + rand(4096);
      const native = text(pieces(stored, 'native', firstIndex, skip, pieceBytes));
      expect(native, `seed ${seed}`).toBe(text(pieces(stored, 'js', firstIndex, skip, pieceBytes)));
      expect(native.endsWith('\n')).toBe(true);
      expect(native.slice(0, -1).split('\n').map((l) => JSON.parse(l)), `seed ${seed}`).toEqual(expected.slice(skip));
    }
  });

  it('stored as NDJSON lines by an earlier version, they pass through as they are, from any item', () => {
    const legacy = Buffer.from('{"i":0,"ciphertext":"kf:v1:AAAA"}\n{"i":1,"error":{"code":"KF_DECRYPT_FAILED","message":"decryption failed"}}\n{"i":2,"plaintext":"x"}\n');
    for (const formatter of formatters) {
      expect(text(pieces(legacy, formatter, 0, 0))).toBe(legacy.toString());
      expect(text(pieces(legacy, formatter, 0, 2))).toBe('{"i":2,"plaintext":"x"}\n');
      expect(pieces(legacy, formatter, 0, 3)).toEqual([]);
    }
  });

  it('refuse to format corrupt records: a clear error from both formatters, never a crash or a wrong line', () => {
    const writer = new ResultWriter();
    writer.ciphertext(1, randomBytes(40));
    writer.error('KF_DECRYPT_FAILED');
    const good = Buffer.from(writer.bytes);
    for (const formatter of formatters) expect(text(pieces(good, formatter, 0, 0)).split('\n').filter(Boolean)).toHaveLength(2);
    const unknownKind = Buffer.from(good);
    unknownKind[1] = 9;
    const badError = Buffer.from(good);
    badError[badError.length - 1] = 200;
    const shortCiphertext = Buffer.from([RESULTS_FORMAT, RECORD_CIPHERTEXT, 2, 0, 0, 0, 1, 2]);
    const longError = Buffer.from([RESULTS_FORMAT, RECORD_ERROR, 2, 0, 0, 0, 0, 0]);
    const boundaries = [1, 1 + 5 + 4 + 40]; // after the format byte, after the ciphertext record
    const cut = Array.from({ length: good.length - 1 }, (_, n) => good.subarray(0, n + 1)).filter((c) => !boundaries.includes(c.length));
    for (const formatter of formatters) {
      for (const stored of [unknownKind, badError, shortCiphertext, longError, Buffer.from([7, 0, 0]), ...cut]) {
        expect(() => pieces(stored, formatter, 0, 0), `${formatter}: ${stored.toString('hex')}`).toThrow(/corrupt results/);
      }
      // Cut at a record boundary, the records before it are whole.
      expect(text(pieces(good.subarray(0, boundaries[1]), formatter, 0, 0)).split('\n').filter(Boolean)).toHaveLength(1);
    }
    // Random bytes after the format byte: an error or lines, never a crash.
    for (let n = 0; n < 300; n++) {
      const junk = Buffer.concat([Buffer.from([RESULTS_FORMAT]), randomBytes(n)]);
      for (const formatter of formatters) {
        try {
          pieces(junk, formatter, 0, 0);
        } catch (err) {
          expect((err as Error).message).toMatch(/corrupt results/);
        }
      }
    }
  });
});

describe('item errors as the kernels write them', () => {
  it('are ASCII JSON of each code and its catalogue message (sync answers of encrypt and rewrap are read as latin1)', () => {
    expect(RESULT_ERROR_JSON).toHaveLength(RESULT_ERRORS.length);
    RESULT_ERROR_JSON.forEach((json, i) => {
      expect(/^[\x20-\x7e]*$/.test(json)).toBe(true);
      expect(JSON.parse(json)).toEqual({ code: RESULT_ERRORS[i], message: CATALOGUE[RESULT_ERRORS[i]!].message });
    });
  });

  it('escape what is past ASCII, and parse back to the same text', () => {
    const message = { message: 'the key’s “version” — ünïcødé 🔑' };
    const json = asciiJson(message);
    expect(/^[\x20-\x7e]*$/.test(json)).toBe(true);
    expect(json).toContain('\\u2019');
    expect(JSON.parse(json)).toEqual(message);
  });
});

describe('the lines of items a failed batch never processed', () => {
  it('are one KF_ITEM_NOT_PROCESSED line per item from `from` to `to`, in pieces split between lines', () => {
    const pieces = [...notProcessedLines(5, 1_005, 4096)];
    expect(pieces.length).toBeGreaterThan(1);
    expect(pieces.every((piece) => piece.at(-1) === 0x0a && piece.length <= 4096 + 200)).toBe(true);
    const lines = Buffer.concat(pieces).toString('utf8').trimEnd().split('\n').map((line) => JSON.parse(line));
    expect(lines).toEqual(Array.from({ length: 1_000 }, (_, k) => ({ i: 5 + k, error: { code: 'KF_ITEM_NOT_PROCESSED', message: CATALOGUE.KF_ITEM_NOT_PROCESSED.message } })));
    expect([...notProcessedLines(7, 7)]).toEqual([]);
  });
});
