import { randomBytes } from 'node:crypto';
import { once } from 'node:events';
import { createRequire } from 'node:module';
import { Worker } from 'node:worker_threads';
import { describe, expect, it } from 'vitest';
import { ChunkPacker, ITEM_NOT_STRING, ITEM_TOO_LARGE } from '../../shared/chunk-codec.js';
import type { ChunkJob } from '../../shared/crypto/chunk-kernel.js';
import { resultFormatter, runChunkInto, type KernelChoice } from '../../shared/crypto/kernel.js';
import { KeyRing, packVersions } from '../../shared/crypto/key-ring.js';
import { nativeKernel } from '../../shared/crypto/native-kernel.js';
import { NonceSource } from '../../shared/crypto/nonces.js';
import { projectRoot } from '../../shared/project-root.js';
import { resultLines } from '../../shared/result-codec.js';

const ring = new KeyRing({
  name: 'kernels',
  type: 'aes256-gcm96',
  latestVersion: 2,
  minDecryptionVersion: 1,
  versions: [
    { version: 1, material: randomBytes(32) },
    { version: 2, material: randomBytes(32) },
  ],
});
const nonces = new NonceSource();

function pack(items: Array<string | Buffer | typeof ITEM_NOT_STRING | typeof ITEM_TOO_LARGE>): Buffer {
  const packer = new ChunkPacker();
  for (const item of items) {
    if (item === ITEM_NOT_STRING || item === ITEM_TOO_LARGE) packer.addRejected(item);
    else packer.add(typeof item === 'string' ? Buffer.from(item) : item);
  }
  return packer.take();
}

/** The result lines of stored records, from the native formatter or the JavaScript one. */
const format = (stored: Uint8Array, formatter: KernelChoice, firstIndex = 0, skip = 0, pieceBytes?: number): Buffer =>
  Buffer.concat([...resultLines(Buffer.from(stored), firstIndex, skip, resultFormatter(formatter), pieceBytes)]);

function run(kernel: KernelChoice, op: ChunkJob['op'], items: Parameters<typeof pack>[0], encoding: 'utf8' | 'base64' = 'utf8', firstIndex = 0) {
  const out = runChunkInto({ op, encoding, maxItemBytes: 1024 }, pack(items), ring, 0, kernel, nonces);
  const text = format(out.buffer, kernel, firstIndex);
  // Whichever kernel wrote the records, both formatters read them into the same bytes.
  expect(format(out.buffer, kernel === 'native' ? 'js' : 'native', firstIndex).equals(text)).toBe(true);
  const lines = text.toString('utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l));
  return { ...out, text, lines };
}

const samples = ['LIC-0001', '', 'ünïcødé ✓ 𝄞', 'quote " backslash \\ tab \t newline \n nul \u0000 del \u007f', 'x'.repeat(1024)];

describe('the native kernel', () => {
  it('is built on this machine (the install runs node-gyp)', () => {
    expect(nativeKernel).toBeDefined();
  });

  for (const [from, to] of [['native', 'js'], ['js', 'native']] as const) {
    it(`${from} ciphertexts decrypt and rewrap under the ${to} kernel, and the lines are identical`, () => {
      const sealed = run(from, 'encrypt', samples, 'utf8', 40);
      expect(sealed.kernel).toBe(from);
      expect(sealed.lines.map((l) => l.i)).toEqual([40, 41, 42, 43, 44]);
      const cts = sealed.lines.map((l) => l.ciphertext as string);
      for (const ct of cts) expect(ct).toMatch(/^kf:v2:[A-Za-z0-9+/]+=*$/);
      const opened = run(to, 'decrypt', cts);
      expect(opened.lines.map((l) => l.plaintext)).toEqual(samples);
      // Same input, same records and lines, whichever kernel wrote them.
      const again = run(from, 'decrypt', cts);
      expect(Buffer.from(again.buffer).equals(Buffer.from(opened.buffer))).toBe(true);
      expect(again.text.equals(opened.text)).toBe(true);
      const rewrapped = run(to, 'rewrap', cts);
      expect(run(from, 'decrypt', rewrapped.lines.map((l) => l.ciphertext)).lines.map((l) => l.plaintext)).toEqual(samples);
    });
  }

  it('fails bad items alone with the same codes as the js kernel', () => {
    const [good] = run('js', 'encrypt', ['fine']).lines.map((l) => l.ciphertext as string);
    const raw = Buffer.from(good!.slice(6), 'base64');
    raw[15]! ^= 1;
    const bad = [good!, `kf:v2:${raw.toString('base64')}`, 'kf:v3:' + good!.slice(6), 'kf:v0:AAAA', 'kf:v2:', 'kf:v2:@@@@', 'kf:v2:' + good!.slice(6, -1), 'nonsense', ITEM_NOT_STRING, ITEM_TOO_LARGE, 'x'.repeat(3000), good!] as const; // 3,000 > any ciphertext of a 1,024-byte plaintext (hex legacy shapes included)
    const js = run('js', 'decrypt', [...bad]);
    const native = run('native', 'decrypt', [...bad]);
    expect(native.lines).toEqual(js.lines);
    expect(native.lines.map((l) => l.plaintext ?? l.error.code)).toEqual([
      'fine', 'KF_DECRYPT_FAILED', 'KF_DECRYPT_FAILED', 'KF_DECRYPT_FAILED', 'KF_DECRYPT_FAILED', 'KF_DECRYPT_FAILED', 'KF_DECRYPT_FAILED',
      'KF_DECRYPT_FAILED', 'KF_INVALID_ITEM', 'KF_ITEM_TOO_LARGE', 'KF_ITEM_TOO_LARGE', 'fine',
    ]);
    expect(native.newerVersionSeen).toBe(true);
    expect([native.succeeded, native.failed]).toEqual([2, 10]);
  });

  it('checks the base64 before the version, as the js kernel does', () => {
    const retired = new KeyRing({ name: 'kernels', type: 'aes256-gcm96', latestVersion: 2, minDecryptionVersion: 2, versions: [{ version: 2, material: randomBytes(32) }] });
    for (const kernel of ['js', 'native'] as const) {
      // Under a version this process has not seen: broken, not a reason to reload the key.
      const newer = run(kernel, 'decrypt', ['kf:v3:not*base64']);
      expect(newer.lines.map((l) => l.error?.code)).toEqual(['KF_DECRYPT_FAILED']);
      expect(newer.newerVersionSeen).toBe(false);
      // Under a version no longer decrypted: broken is still broken; well-formed is disabled.
      const out = runChunkInto({ op: 'decrypt', encoding: 'utf8', maxItemBytes: 1024 }, pack(['kf:v1:not*base64', `kf:v1:${'A'.repeat(40)}`]), retired, 0, kernel, nonces);
      const codes = format(out.buffer, kernel).toString('utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l).error?.code);
      expect(codes).toEqual(['KF_DECRYPT_FAILED', 'KF_KEY_VERSION_DISABLED']);
    }
  });

  it('accepts only the spelling of a ciphertext it writes: non-zero padding bits and leading-zero versions fail in both kernels', () => {
    // Plaintext lengths 1 and 2 leave 28 + n sealed bytes: both padding shapes ('==' and '=') occur.
    const cts = run('native', 'encrypt', ['a', 'bb', 'ccc']).lines.map((l) => l.ciphertext as string);
    expect(cts.some((c) => c.endsWith('=='))).toBe(true);
    expect(cts.some((c) => /[^=]=$/.test(c))).toBe(true);
    const respell = (c: string): string => {
      const pad = c.endsWith('==') ? 3 : c.endsWith('=') ? 2 : 0;
      if (!pad) return c;
      const at = c.length - pad; // the last character before the padding: flip a bit the padding discards
      const alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/';
      return c.slice(0, at) + alphabet[alphabet.indexOf(c[at]!) ^ 1] + c.slice(at + 1);
    };
    const variants = [...cts.map(respell).filter((v, i) => v !== cts[i]), ...cts.map((c) => c.replace('kf:v2:', 'kf:v02:'))];
    expect(variants.length).toBeGreaterThanOrEqual(5);
    for (const kernel of ['js', 'native'] as const) {
      expect(run(kernel, 'decrypt', cts).lines.map((l) => l.plaintext)).toEqual(['a', 'bb', 'ccc']);
      expect(run(kernel, 'decrypt', variants).lines.map((l) => l.error?.code)).toEqual(variants.map(() => 'KF_DECRYPT_FAILED'));
    }
  });

  it('handles base64 plaintexts both ways like the js kernel', () => {
    const bytes = [Buffer.from([0, 255, 10]), Buffer.alloc(0), randomBytes(100)].map((b) => b.toString('base64'));
    const sealed = run('native', 'encrypt', [...bytes, 'not base64!'], 'base64');
    expect(sealed.lines.at(-1).error.code).toBe('KF_INVALID_ENCODING');
    const cts = sealed.lines.slice(0, 3).map((l) => l.ciphertext);
    expect(run('js', 'decrypt', cts, 'base64').lines.map((l) => l.plaintext)).toEqual(bytes);
    expect(run('native', 'decrypt', cts, 'base64').lines.map((l) => l.plaintext)).toEqual(bytes);
    expect(run('native', 'decrypt', [cts[0]]).lines[0].error.code).toBe('KF_NOT_UTF8');
  });

  it('survives random and truncated input: a clear error for broken framing, never a crash or a wrong answer', () => {
    const valid = pack(samples);
    for (let cut = 0; cut < valid.length; cut += 7) {
      const truncated = valid.subarray(0, cut);
      let jsError: unknown;
      let nativeError: unknown;
      try { runChunkInto({ op: 'encrypt', encoding: 'utf8', maxItemBytes: 1024 }, truncated, ring, 0, 'js', nonces); } catch (e) { jsError = e; }
      try { runChunkInto({ op: 'encrypt', encoding: 'utf8', maxItemBytes: 1024 }, truncated, ring, 0, 'native', nonces); } catch (e) { nativeError = e; }
      expect(Boolean(nativeError), `cut at ${cut}`).toBe(Boolean(jsError));
    }
    // Random ciphertext-shaped garbage of every length: every item fails alone, uniformly.
    const garbage = Array.from({ length: 2000 }, (_, n) => `kf:v${1 + (n % 3)}:${randomBytes(n % 90).toString('base64')}`);
    const out = run('native', 'decrypt', garbage);
    expect(out.failed).toBe(2000);
    expect(new Set(out.lines.map((l) => l.error.code))).toEqual(new Set(['KF_DECRYPT_FAILED']));
    // Random framing bytes: the kernel either refuses the chunk or reports every item it read.
    for (let n = 0; n < 300; n++) {
      const junk = randomBytes(n);
      try {
        const r = runChunkInto({ op: 'decrypt', encoding: 'utf8', maxItemBytes: 1 << 20 }, junk, ring, 0, 'native', nonces);
        expect(r.succeeded).toBe(0);
        expect(r.failed).toBe(r.count);
      } catch (err) {
        expect((err as Error).message).toMatch(/corrupt chunk/);
      }
    }
  });
  it('opens every version of a key rotated hundreds of times, its versions given to the ring in any order, as the js kernel does', () => {
    const material = Array.from({ length: 300 }, () => randomBytes(32));
    // Versions 1..300 but 150, handed over shuffled: the kernel's lookup must not depend on the order.
    const versions = material.map((m, i) => ({ version: i + 1, material: m })).filter((v) => v.version !== 150).sort(() => Math.random() - 0.5);
    const many = new KeyRing({ name: 'rotated', type: 'aes256-gcm96', latestVersion: 300, minDecryptionVersion: 1, versions });
    const job = { op: 'encrypt', encoding: 'utf8', maxItemBytes: 1024 } as const;
    // One item sealed under each version (a ring pinned to it), by either kernel.
    const cts = [1, 2, 149, 151, 299, 300].flatMap((v) =>
      (['js', 'native'] as const).map((kernel) => JSON.parse(format(runChunkInto(job, pack([`v${v}`]), many.pinned(v), 0, kernel, nonces).buffer, kernel).toString()).ciphertext as string),
    );
    const missing = cts[0]!.replace('kf:v1:', 'kf:v150:');
    for (const kernel of ['js', 'native'] as const) {
      const out = runChunkInto({ ...job, op: 'decrypt' }, pack([...cts, missing]), many, 0, kernel, nonces);
      const lines = format(out.buffer, kernel).toString('utf8').split('\n').filter(Boolean).map((l) => JSON.parse(l));
      expect(lines.map((l) => l.plaintext ?? l.error.code)).toEqual([...['v1', 'v2', 'v149', 'v151', 'v299', 'v300'].flatMap((p) => [p, p]), 'KF_DECRYPT_FAILED']);
    }
  });

  it('refuses key versions it cannot read with a clear error, and reads none past the buffer', () => {
    const params = new Uint32Array([1, 0, 0, 0, 1024, 2, 1]); // decrypt, records, latest 2
    const two = new KeyRing({ name: 'k', type: 'aes256-gcm96', latestVersion: 2, minDecryptionVersion: 1, versions: [1, 2].map((version) => ({ version, material: randomBytes(32) })) });
    const sealed = runChunkInto({ op: 'encrypt', encoding: 'utf8', maxItemBytes: 1024 }, pack(['under v1']), two.pinned(1), 0, 'native', nonces);
    const input = pack([JSON.parse(format(sealed.buffer, 'native').toString()).ciphertext]);
    const out = Buffer.alloc(4096);
    const entries = [1, 2].map((version) => ({ version, key: two.version(version)!.material, aad: two.version(version)!.aad }));
    const good = Buffer.from(packVersions(entries));
    expect(nativeKernel!.run(params, good, input, out).slice(2, 4)).toEqual([1, 0]);
    const withHeader = (count: number, stride: number, body = good.subarray(8)) => Buffer.concat([Buffer.from(new Uint32Array([count, stride]).buffer), body]);
    const refused: Array<[unknown, RegExp]> = [
      [[{ version: 1, key: randomBytes(32), aad: Buffer.alloc(0) }], /Uint8Array of packed key versions/],
      [good.subarray(0, 7), /Uint8Array of packed key versions/],
      [good.subarray(0, good.length - 1), /count entries of stride bytes/],
      [withHeader(0, good.readUInt32LE(4)), /count entries/],
      [withHeader(3, good.readUInt32LE(4)), /count entries/],
      [withHeader(2, 39, good.subarray(8, 8 + 78)), /each at least 40/],
      [withHeader(0xffffffff, 0xffffffff), /count entries/],
      [packVersions(entries.slice(0, 1)), /the latest version/],
    ];
    for (const [versions, message] of refused) expect(() => nativeKernel!.run(params, versions as Uint8Array, input, out)).toThrow(message);
    // An entry whose aad length runs past its stride is not found: its items fail, nothing is read past it.
    const overlong = Buffer.from(good);
    overlong.writeUInt32LE(0xfffffff0, 8 + 4);
    expect(nativeKernel!.run(params, overlong, input, out).slice(2, 4)).toEqual([0, 1]);
    expect(() => packVersions([entries[0]!, entries[0]!])).toThrow(/one entry per version/);
  });

  it('decrypts right while other threads load the addon: loading writes nothing threads share', async () => {
    // Every worker thread loads the addon; a table filled at load once read as "not base64"
    // for a moment in threads already decoding, and items failed for good.
    const items = Array.from({ length: 2_000 }, (_, i) => `item-${i}`);
    const input = pack(run('native', 'encrypt', items).lines.map((l) => l.ciphertext as string));
    const load = `require(${JSON.stringify(createRequire(import.meta.url).resolve('node-gyp-build'))})(${JSON.stringify(projectRoot())})`;
    let stop = false;
    let loads = 0;
    const errors: Error[] = [];
    const loaders = new Set<Worker>();
    const spawn = (): void => {
      if (stop) return;
      loads++;
      const worker = new Worker(load, { eval: true });
      loaders.add(worker);
      worker.on('error', (err) => errors.push(err));
      worker.on('exit', () => {
        loaders.delete(worker);
        spawn();
      });
    };
    for (let i = 0; i < 4; i++) spawn();
    let runs = 0;
    let failed = 0;
    const until = Date.now() + 2_000;
    while (Date.now() < until) {
      failed += runChunkInto({ op: 'decrypt', encoding: 'utf8', maxItemBytes: 1024 }, input, ring, 0, 'native', nonces).failed;
      runs++;
      await new Promise((resolve) => setImmediate(resolve));
    }
    stop = true;
    await Promise.all([...loaders].map((worker) => once(worker, 'exit')));
    expect(errors).toEqual([]);
    expect(loads).toBeGreaterThan(10);
    expect(runs).toBeGreaterThan(10);
    expect(failed).toBe(0);
  });

  it('packLines refuses ranges outside its buffers, and never writes past the output it is given', () => {
    const src = Buffer.from('"a"\n"bb"\n"ccc"\n');
    const state = (start: number, end: number, outAt: number) => new Uint32Array([start, end, outAt, 100, 64, 0, 0, 0]);
    for (const [start, end, outAt] of [[5, 2, 0], [0, src.length + 1, 0], [0, src.length, 65], [0x7fffffff, 0xffffffff, 0]] as const) {
      expect(() => nativeKernel!.packLines(src, Buffer.alloc(64), state(start, end, outAt))).toThrow(/out of bounds/);
    }
    expect(() => nativeKernel!.packLines(src, Buffer.alloc(64), new Uint32Array(3))).toThrow(/Uint32Array\(8\)/);
    // An output too small for the next item is refused, with nothing written past its end.
    const out = Buffer.alloc(16, 0xee);
    expect(() => nativeKernel!.packLines(src, out.subarray(0, 12), state(0, src.length, 0))).toThrow(/too small/);
    expect(out.subarray(12).every((b) => b === 0xee)).toBe(true);
    const ok = state(0, src.length, 0);
    nativeKernel!.packLines(src, Buffer.alloc(64), ok);
    expect([ok[2], ok[5], ok[6], ok[7]]).toEqual([5 * 3 + 6, 3, src.length, 0]);
  });
});

describe('the chunk packer', () => {
  it('hands out a chunk as a view, then wipes it and starts the next chunk empty', () => {
    const packer = new ChunkPacker();
    for (const s of samples) packer.add(Buffer.from(s));
    let seen: Buffer | undefined;
    const copied = packer.takeView((view) => Buffer.from((seen = view)));
    expect(copied.equals(pack(samples))).toBe(true);
    expect(seen!.every((b) => b === 0)).toBe(true); // the plaintexts do not stay in the packer's buffer
    expect(packer.count).toBe(0);
    packer.add(Buffer.from('next'));
    expect(packer.take().equals(pack(['next']))).toBe(true);
  });
});
