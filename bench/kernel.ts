import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { ChunkPacker } from '../shared/chunk-codec.js';
import { runChunkInto, type KernelChoice } from '../shared/crypto/kernel.js';
import { KeyRing } from '../shared/crypto/key-ring.js';
import { nativeKernel } from '../shared/crypto/native-kernel.js';
import { NonceSource } from '../shared/crypto/nonces.js';
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

/** A packed chunk of the ciphertexts in one encrypt output (its lines are `{"ciphertext":…}`). */
function packCiphertexts(output: Uint8Array): Buffer {
  const packer = new ChunkPacker();
  for (const line of Buffer.from(output.buffer, output.byteOffset, output.byteLength).toString('utf8').split('\n')) {
    if (line) packer.add(Buffer.from((JSON.parse(line) as { ciphertext: string }).ciphertext));
  }
  return packer.take();
}

/**
 * Milliseconds inside `run` over every chunk, one at a time. Each output goes to `use` outside
 * the clock and is then dropped, as a worker thread hands its result back and takes the next.
 */
function timeChunks(chunks: readonly Buffer[], run: (chunk: Buffer, index: number) => Uint8Array, use: (output: Uint8Array) => void = () => {}): number {
  let ns = 0n;
  chunks.forEach((chunk, i) => {
    const start = process.hrtime.bigint();
    const output = run(chunk, i);
    ns += process.hrtime.bigint() - start;
    use(output);
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
 * The limit: 32-byte AES-256-GCM seals per second on one core by `openssl speed`
 * (the cipher alone: no nonces drawn, no encoding). Undefined where the openssl command is not
 * installed.
 */
function opensslSealsPerSecond(seconds: number): number | undefined {
  // It prints its count ("Doing AES-256-GCM for 3s on 32 size blocks: N AES-256-GCM's in 3.00s") on stderr.
  const { stderr } = spawnSync('openssl', ['speed', '-seconds', String(seconds), '-evp', 'aes-256-gcm', '-bytes', '32'], { encoding: 'utf8' });
  const m = /: (\d+) AES-256-GCM's in ([\d.]+)s/.exec(stderr ?? '');
  return m ? Number(m[1]) / Number(m[2]) : undefined;
}

/**
 * Items/s on one thread for each op and kernel, against the naive per-item loop over the same
 * items; the native encrypt also against the OpenSSL limit.
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
  for (const [kernel, keys] of runs) {
    const run = (op: 'encrypt' | 'decrypt' | 'rewrap') => (chunk: Buffer, i: number) => runChunkInto({ op, encoding: 'utf8', firstIndex: i * CHUNK, maxItemBytes: 65_536 }, chunk, keys, 0, kernel, nonces).buffer;
    timeChunks(plain.slice(0, 2), run('encrypt')); // warm up
    const cts: Buffer[] = [];
    const encMs = timeChunks(plain, run('encrypt'), (output) => cts.push(packCiphertexts(output)));
    const decMs = timeChunks(cts, run('decrypt'));
    const rewMs = timeChunks(cts, run('rewrap'));
    for (const [op, ms] of [['encrypt', encMs], ['decrypt', decMs], ['rewrap', rewMs]] as const) {
      const rate = n / (ms / 1000);
      rows.push({ section: 'kernel', name: `${kernel === 'js' ? 'node:crypto/libsodium' : kernel} kernel, ${op}, ${keys.type}`, value: rate, unit: 'items/s/core', reference: naiveRate, ratio: rate / naiveRate });
    }
  }
  const limit = opensslSealsPerSecond(limitSeconds);
  const native = rows.find((r) => r.name === 'native kernel, encrypt, aes256-gcm96');
  if (limit !== undefined && native) {
    rows.push({ section: 'kernel', name: 'native kernel, encrypt, aes256-gcm96, vs the OpenSSL limit (openssl speed -evp aes-256-gcm -bytes 32)', value: native.value, unit: 'items/s/core', reference: limit, ratio: native.value / limit });
  }
  return rows;
}
