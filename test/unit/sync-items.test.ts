import { describe, expect, it } from 'vitest';
import { z } from 'zod';
import { context, readSyncItem } from '../../shared/schemas.js';

// The zod union the sync routes read items with until it proved too slow for bad items: the
// hand-written check must take and refuse exactly what it did, but for text that is not
// well-formed (a lone surrogate), which it refuses too (context's own schema does).
const text = z.string().refine((s) => s.isWellFormed());
const unionWithCatch = z
  .union([
    z.union([
      text,
      z.object({ plaintext: text, context: context.optional() }).strict(),
      z.object({ ciphertext: text, context: context.optional() }).strict(),
    ]),
    z.null(),
  ])
  .catch(null);

describe('items of a sync request', () => {
  it('are read as the zod union with .catch(null) read them, whatever their kind, but for text with a lone surrogate', () => {
    const elements: unknown[] = [
      'text', '', 'ünïcødé ✓', 0, 1.5, -1, true, false, null, [], ['text'], {},
      { plaintext: 'x' }, { ciphertext: 'x' }, { plaintext: '' }, { plaintext: 'x', context: 'c' }, { context: 'c', ciphertext: 'x' },
      { plaintext: 'x', context: '' }, { plaintext: 'x', context: 'c'.repeat(1024) }, { plaintext: 'x', context: 'c'.repeat(1025) },
      { plaintext: 'x', context: '✓'.repeat(1024) }, { plaintext: 'x', context: '😀'.repeat(512) }, { plaintext: 'x', context: '😀'.repeat(513) },
      { plaintext: 'x', context: `${'😀'.repeat(1023)}x` }, { plaintext: 'x', context: '😀'.repeat(1024) }, { plaintext: 'x', context: '😀'.repeat(1025) }, { plaintext: 'x', context: '\ud800'.repeat(1024) }, { plaintext: 'x', context: '\ud800'.repeat(1025) },
      { plaintext: 'x', context: null }, { plaintext: 'x', context: 5 }, { plaintext: 5 }, { plaintext: null }, { plaintext: ['x'] },
      { plaintext: 'x', ciphertext: 'y' }, { plaintext: 'x', extra: 1 }, { ciphertext: 'x', context: 'c', extra: 1 }, { context: 'c' },
      { Plaintext: 'x' }, { plaintext: { plaintext: 'x' } },
      '\ud800', 'a\udc00b', '😀\ud83d', '\ud83d\ude00', { plaintext: '\ud800' }, { ciphertext: 'x\udfff' }, { plaintext: 'x', context: '\ud800' }, { plaintext: 'x', context: 'c\ud800c' },
    ];
    for (const element of elements) {
      // JSON round trip: items come from a parsed body.
      const parsed: unknown = JSON.parse(JSON.stringify(element));
      expect(JSON.stringify(readSyncItem(parsed)), JSON.stringify(element)).toBe(JSON.stringify(unionWithCatch.parse(parsed)));
    }
  });
});
