import { randomBytes } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { KeyRing } from '../../shared/crypto/key-ring.js';
import { runSync } from '../../producer/sync-crypto.js';

// Its own file: the sync path's packing buffer lives as long as the module, and this test needs
// it at its first size (64 KiB), so that the request below makes it grow to the size estimated.
const ring = new KeyRing({ name: 'packing', type: 'aes256-gcm96', latestVersion: 1, minDecryptionVersion: 1, versions: [{ version: 1, material: randomBytes(32) }] });
const MAX_ITEM_BYTES = 64 * 1024;

describe('the sync path', () => {
  it('seals every byte of items of three bytes a UTF-16 unit, at MAX_ITEM_BYTES, that outgrow the packing buffer', () => {
    // The packing buffer is sized from 3 bytes a unit and written without measuring each item:
    // if the estimate fell short, a write would stop at the buffer's end and an item would be
    // sealed cut short. These take exactly 3 bytes a unit (a lone surrogate goes out as U+FFFD).
    const items = ['€'.repeat(21_845), `${'\ud800'.repeat(21_844)}x`, '€'.repeat(21_845), 'end'];
    expect(items.map((item) => Buffer.byteLength(item))).toEqual([65_535, 65_533, 65_535, 3]);
    const sealed = runSync({ op: 'encrypt', items, encoding: 'utf8', maxItemBytes: MAX_ITEM_BYTES }, ring, 'auto');
    const ciphertexts = (JSON.parse(sealed.body) as { results: Array<{ ciphertext: string }> }).results.map((r) => r.ciphertext);
    expect(sealed.succeeded).toBe(items.length);
    // Opened item by item with node:crypto, whichever kernel sealed them.
    const opened = runSync({ op: 'decrypt', items: ciphertexts, encoding: 'utf8', maxItemBytes: MAX_ITEM_BYTES }, ring, 'js');
    const plaintexts = (JSON.parse(opened.body) as { results: Array<{ plaintext: string }> }).results.map((r) => r.plaintext);
    // Lengths first: a failure then reads as a number, not as two 65 KB strings.
    const expected = items.map((item) => Buffer.from(item).toString());
    expect(plaintexts.map((p) => Buffer.byteLength(p))).toEqual(expected.map((p) => Buffer.byteLength(p)));
    expect(plaintexts.every((p, i) => p === expected[i])).toBe(true);
  });
});
