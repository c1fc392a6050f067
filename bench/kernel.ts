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

function linesOf(outputs: Uint8Array[]): string[] {
  return outputs.flatMap((o) => Buffer.from(o).toString('utf8').split('\n').filter(Boolean).map((l) => (JSON.parse(l) as { ciphertext: string }).ciphertext));
}

/** Items/s on one thread for each op and kernel, against the naive per-item loop over the same items. */
export function kernelBench(n: number): Row[] {
  const key = randomBytes(32);
  const ring = new KeyRing({ name: 'bench', type: 'aes256-gcm96', latestVersion: 1, minDecryptionVersion: 1, versions: [{ version: 1, material: key }] });
  const items = makeItems(n);
  const nonces = new NonceSource();
  naiveEncrypt(items.slice(0, 20_000), key, Buffer.from('kf:bench:v1')); // warm up
  const naiveMs = timeMs(() => naiveEncrypt(items, key, Buffer.from('kf:bench:v1')));
  const naiveRate = n / (naiveMs / 1000);
  const rows: Row[] = [{ section: 'kernel', name: 'naive per-item loop, encrypt (reference)', value: naiveRate, unit: 'items/s/core', reference: naiveRate, ratio: 1 }];

  const plain = packChunks(items);
  const xchacha = new KeyRing({ ...ring.toData(), type: 'xchacha20-poly1305' });
  // AES-GCM on each kernel; XChaCha20-Poly1305 exists only on the node:crypto/libsodium one.
  const runs: Array<[KernelChoice, KeyRing]> = [...(nativeKernel ? [['native', ring] as [KernelChoice, KeyRing]] : []), ['js', ring], ['js', xchacha]];
  for (const [kernel, keys] of runs) {
    const run = (op: 'encrypt' | 'decrypt' | 'rewrap', chunks: Buffer[]) => chunks.map((c, i) => runChunkInto({ op, encoding: 'utf8', firstIndex: i * CHUNK, maxItemBytes: 65_536 }, c, keys, 0, kernel, nonces).buffer);
    run('encrypt', plain.slice(0, 2)); // warm up
    let sealed: Uint8Array[] = [];
    const encMs = timeMs(() => (sealed = run('encrypt', plain)));
    const cts = packChunks(linesOf(sealed));
    const decMs = timeMs(() => run('decrypt', cts));
    const rewMs = timeMs(() => run('rewrap', cts));
    for (const [op, ms] of [['encrypt', encMs], ['decrypt', decMs], ['rewrap', rewMs]] as const) {
      const rate = n / (ms / 1000);
      rows.push({ section: 'kernel', name: `${kernel === 'js' ? 'node:crypto/libsodium' : kernel} kernel, ${op}, ${keys.type}`, value: rate, unit: 'items/s/core', reference: naiveRate, ratio: rate / naiveRate });
    }
  }
  return rows;
}
