import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { ChunkPacker } from '../shared/chunk-codec.js';
import { resultFormatter, runChunkInto, type KernelChoice, type KernelOutput } from '../shared/crypto/kernel.js';
import { KeyRing } from '../shared/crypto/key-ring.js';
import { nativeKernel } from '../shared/crypto/native-kernel.js';
import { NonceSource } from '../shared/crypto/nonces.js';
import { runSync } from '../producer/sync-crypto.js';
import { resultLines } from '../shared/result-codec.js';
import { makeItems, naiveEncrypt, timeMs } from './naive.js';
import type { Row } from './report.js';

const CHUNK = 10_000;

function packChunks(items: readonly string[]): Buffer[] {
  const chunks: Buffer[] = [];
  for (let at = 0; at < items.length; at += CHUNK) {
    const packer = new ChunkPacker();
    for (const item of items.slice(at, at + CHUNK)) packer.add(Buffer.from(item));
    chunks.push(packer.take());
  }
  return chunks;
}

/** A chunk's result lines, as the API formats them for the download (native where the kernel is). */
function resultText(output: KernelOutput): string {
  const stored = Buffer.from(output.buffer.buffer, output.buffer.byteOffset, output.buffer.byteLength);
  return Buffer.concat([...resultLines(stored, 0, 0, resultFormatter(output.kernel))]).toString('utf8');
}

/** A packed chunk of the ciphertexts in one encrypt output (its lines are `{"i":…,"ciphertext":…}`). */
function packCiphertexts(output: KernelOutput): Buffer {
  const packer = new ChunkPacker();
  for (const line of resultText(output).split('\n')) {
    if (line) packer.add(Buffer.from((JSON.parse(line) as { ciphertext: string }).ciphertext));
  }
  return packer.take();
}

type Op = 'encrypt' | 'decrypt' | 'rewrap';

/**
 * Milliseconds inside `run` over every chunk, one at a time, and in turning its records into
 * result lines (the worker's part and the API's part of each item); each output is dropped
 * before the next chunk, as a worker thread hands its result back. A chunk with a failed item
 * is an error (checked outside the clock): a kernel that fails fast must not read as a fast kernel.
 */
function timeChunks(chunks: readonly Buffer[], run: (chunk: Buffer) => KernelOutput): number {
  let ns = 0n;
  chunks.forEach((chunk, i) => {
    const start = process.hrtime.bigint();
    const output = run(chunk);
    const stored = Buffer.from(output.buffer.buffer, output.buffer.byteOffset, output.buffer.byteLength);
    for (const piece of resultLines(stored, i * CHUNK, 0, resultFormatter(output.kernel))) void piece;
    ns += process.hrtime.bigint() - start;
    const { failed } = output;
    if (failed > 0) throw new Error(`bench: chunk ${i}: ${failed} items failed`);
  });
  return Number(ns) / 1e6;
}

/** The naive loop's items/s, and the same items packed in chunks; the million strings die here. */
function reference(n: number, key: Buffer): { naiveRate: number; plain: Buffer[] } {
  const items = makeItems(n);
  naiveEncrypt(items.slice(0, 20_000), key, Buffer.from('kf:bench:v1')); // warm up
  const naiveMs = timeMs(() => naiveEncrypt(items, key, Buffer.from('kf:bench:v1')));
  return { naiveRate: n / (naiveMs / 1000), plain: packChunks(items) };
}

/**
 * The issue's limit, by `openssl speed` in its AEAD mode: per 32-byte message it sets the key
 * and nonce, adds 13 bytes of AAD, encrypts and finishes with the tag (apps/speed.c,
 * EVP_Update_loop_aead_enc), counted over wall-clock time. Undefined, with a warning, where
 * openssl is missing or its output is not understood.
 */
function opensslSealsPerSecond(seconds: number): number | undefined {
  const args = ['speed', '-aead', '-elapsed', '-seconds', String(seconds), '-evp', 'aes-256-gcm', '-bytes', '32'];
  const { stderr, error } = spawnSync('openssl', args, { encoding: 'utf8' });
  // "Doing AES-256-GCM for 3s on 32 size blocks: 6201234 AES-256-GCM's in 3.00s" (3.0; later
  // versions say "ops in", 1.1 names the cipher in lower case).
  const m = /: (\d+) (?:aes-256-gcm's|ops) in ([\d.]+)s/i.exec(stderr ?? '');
  if (!m) console.warn(`bench: no OpenSSL limit row: openssl ${args.join(' ')} ${error ? `did not run (${error.message})` : `printed nothing like "N AES-256-GCM's in Ts"`}`);
  return m ? Number(m[1]) / Number(m[2]) : undefined;
}

/**
 * Items/s on one thread for each op and kernel over `n` items, against the naive per-item loop
 * over the same items; the native encrypt also against the OpenSSL limit, measured for
 * `limitSeconds`.
 */
export function kernelBench(n: number, limitSeconds: number): Row[] {
  const key = randomBytes(32);
  const ring = new KeyRing({ name: 'bench', type: 'aes256-gcm96', latestVersion: 1, minDecryptionVersion: 1, versions: [{ version: 1, material: key }] });
  const nonces = new NonceSource();
  const { naiveRate, plain } = reference(n, key);
  const rows: Row[] = [{ section: 'kernel', name: 'naive per-item loop, encrypt (reference)', value: naiveRate, unit: 'items/s/core', reference: naiveRate, ratio: 1 }];

  const xchacha = new KeyRing({ ...ring.toData(), type: 'xchacha20-poly1305' });
  // AES-GCM on each kernel; XChaCha20-Poly1305 exists only on the node:crypto/libsodium one.
  const runs: Array<[KernelChoice, KeyRing]> = [...(nativeKernel ? [['native', ring] as [KernelChoice, KeyRing]] : []), ['js', ring], ['js', xchacha]];
  let nativeEncrypt: number | undefined;
  for (const [kernel, keys] of runs) {
    const run = (op: Op) => (chunk: Buffer) => runChunkInto({ op, encoding: 'utf8', maxItemBytes: 65_536 }, chunk, keys, 0, kernel, nonces);
    // Ciphertexts for decrypt and rewrap, made before and outside any clock.
    const cts = plain.map((chunk) => packCiphertexts(run('encrypt')(chunk)));
    const rates = (['encrypt', 'decrypt', 'rewrap'] as const).map((op) => {
      const input = op === 'encrypt' ? plain : cts;
      timeChunks(input.slice(0, 2), run(op)); // warm up
      return [op, n / (timeChunks(input, run(op)) / 1000)] as const;
    });
    for (const [op, rate] of rates) {
      if (kernel === 'native' && op === 'encrypt') nativeEncrypt = rate;
      rows.push({ section: 'kernel', name: `${kernel === 'js' ? 'node:crypto/libsodium' : kernel} kernel, ${op}, ${keys.type}`, value: rate, unit: 'items/s/core', reference: naiveRate, ratio: rate / naiveRate });
    }
  }
  if (nativeKernel) {
    // Each item under another version in both, so both change keys as often: what differs is the key's size.
    const [ten, year] = [10, 366].map((versions) => syncDecryptMicros(versions, 100_000));
    rows.push({ section: 'kernel', name: 'native kernel, a 10-item sync decrypt, each item under another version, of a key of 366 versions (a year of daily rotation) vs of 10', value: year!, unit: 'µs/call', reference: ten!, ratio: year! / ten! });
  }
  const limit = nativeEncrypt === undefined ? undefined : opensslSealsPerSecond(limitSeconds);
  if (nativeEncrypt !== undefined && limit !== undefined) {
    rows.push({ section: 'kernel', name: 'native kernel, encrypt, aes256-gcm96, vs the OpenSSL limit (openssl speed -aead -evp aes-256-gcm -bytes 32)', value: nativeEncrypt, unit: 'items/s/core', reference: limit, ratio: nativeEncrypt / limit });
  }
  return rows;
}

/** µs per call of the sync path's crypto (producer/sync-crypto.ts): 10 items to decrypt, sealed under versions spread over a key of `versions`. */
function syncDecryptMicros(versions: number, calls: number): number {
  const ring = new KeyRing({
    name: 'bench', type: 'aes256-gcm96', latestVersion: versions, minDecryptionVersion: 1,
    versions: Array.from({ length: versions }, (_, i) => ({ version: i + 1, material: randomBytes(32) })),
  });
  const items = makeItems(10, 'versions').map((item, i) => {
    const { body } = runSync({ op: 'encrypt', items: [item], encoding: 'utf8', maxItemBytes: 4096 }, ring.pinned(1 + Math.floor((i * (versions - 1)) / 9)), 'native');
    return (JSON.parse(body) as { results: Array<{ ciphertext: string }> }).results[0]!.ciphertext;
  });
  const request = { op: 'decrypt', items, encoding: 'utf8', maxItemBytes: 4096 } as const;
  if (runSync(request, ring, 'native').failed !== 0) throw new Error(`bench: a 10-item sync decrypt under a key of ${versions} versions failed items`);
  for (let i = 0; i < 1000; i++) runSync(request, ring, 'native'); // warm up
  return (timeMs(() => {
    for (let i = 0; i < calls; i++) runSync(request, ring, 'native');
  }) * 1000) / calls;
}
