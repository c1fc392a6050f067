import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import { ChunkPacker } from '../../shared/chunk-codec.js';
import { gcmOpen, gcmSeal } from '../../shared/crypto/aes-gcm.js';
import { packVersions } from '../../shared/crypto/key-ring.js';
import { nativeKernel } from '../../shared/crypto/native-kernel.js';
import { RESULTS_FORMAT, resultLines } from '../../shared/result-codec.js';

// Project Wycheproof AES-GCM vectors (Apache-2.0, test/fixtures/wycheproof/LICENSE): the groups
// keyfleet uses, 256-bit keys, 96-bit nonces, 128-bit tags.
interface Vector { tcId: number; key: string; iv: string; aad: string; msg: string; ct: string; tag: string; result: 'valid' | 'invalid' | 'acceptable'; flags: string[] }
interface Group { keySize: number; ivSize: number; tagSize: number; tests: Vector[] }
const file = JSON.parse(readFileSync(resolve(import.meta.dirname, '..', 'fixtures', 'wycheproof', 'aes_gcm_test.json'), 'utf8')) as { testGroups: Group[] };
const vectors = file.testGroups.filter((g) => g.keySize === 256 && g.ivSize === 96 && g.tagSize === 128).flatMap((g) => g.tests);
const hex = (s: string) => Buffer.from(s, 'hex');

describe('AES-256-GCM against the Wycheproof vectors', () => {
  it('has vectors of both kinds to check', () => {
    expect(vectors.filter((v) => v.result === 'valid').length).toBeGreaterThan(10);
    expect(vectors.filter((v) => v.result === 'invalid').length).toBeGreaterThan(10);
  });

  it('node:crypto engine: valid vectors seal to their ciphertext and open to their message; invalid ones are refused', () => {
    for (const v of vectors) {
      const sealed = Buffer.concat([hex(v.iv), hex(v.ct), hex(v.tag)]);
      const opened = gcmOpen(hex(v.key), hex(v.aad), sealed);
      if (v.result === 'invalid') {
        expect(opened, `tcId ${v.tcId} (${v.flags.join(',')})`).toBeUndefined();
      } else {
        expect(opened?.toString('hex'), `tcId ${v.tcId}`).toBe(v.msg);
        expect(gcmSeal(hex(v.key), hex(v.iv), hex(v.aad), hex(v.msg)).toString('hex'), `tcId ${v.tcId}`).toBe(sealed.toString('hex'));
      }
    }
  });

  it('native kernel: opens every valid vector to its message and fails every invalid one, in one chunk', () => {
    expect(nativeKernel).toBeDefined();
    // One chunk per vector key (the kernel holds one key per version); the vector's AAD stands in
    // for keyfleet's `kf:{name}:v{version}`.
    for (const v of vectors) {
      const packer = new ChunkPacker();
      packer.add(Buffer.from(`kf:v1:${Buffer.concat([hex(v.iv), hex(v.ct), hex(v.tag)]).toString('base64')}`));
      const input = packer.take();
      const out = Buffer.alloc(4096);
      out[0] = RESULTS_FORMAT;
      const params = new Uint32Array([1, 1, 0, 0, 1 << 20, 1, 1]); // decrypt, base64 out, records
      const [written, count, succeeded] = nativeKernel!.run(params, packVersions([{ version: 1, key: hex(v.key), aad: hex(v.aad) }]), input, out.subarray(1));
      const [text] = resultLines(out.subarray(0, 1 + written), 0, 0, nativeKernel);
      const line = JSON.parse(text!.toString()) as { plaintext?: string; error?: { code: string } };
      expect(count).toBe(1);
      if (v.result === 'invalid') {
        expect(succeeded, `tcId ${v.tcId}`).toBe(0);
        expect(line.error?.code).toBe('KF_DECRYPT_FAILED');
      } else {
        expect(Buffer.from(line.plaintext ?? '', 'base64').toString('hex'), `tcId ${v.tcId}`).toBe(v.msg);
      }
    }
  });
});
