import { afterEach, describe, expect, it, vi } from 'vitest';
import { Progress } from '../../client/progress.js';

/** The lines a non-interactive Progress writes to stderr while `run` drives it. */
function linesOf(unit: 'items' | 'bytes', run: (progress: Progress) => void): string[] {
  const written: string[] = [];
  vi.spyOn(process.stderr, 'write').mockImplementation((chunk: string | Uint8Array) => {
    written.push(String(chunk));
    return true;
  });
  const progress = new Progress('keyfleet: upload', unit, false);
  run(progress);
  progress.stop();
  vi.restoreAllMocks();
  return written.join('').split('\n').filter(Boolean);
}

describe('the CLI progress lines', () => {
  afterEach(() => vi.restoreAllMocks());

  it('give a byte count in the unit its total reaches, so a small file does not read 0.0 MB', () => {
    const started = Date.now() - 1_000;
    expect(linesOf('bytes', (p) => p.update(12, 12, started))).toEqual([expect.stringMatching(/^keyfleet: upload 12\/12 B \(100%\), \d+ B\/s, ETA 0s$/)]);
    expect(linesOf('bytes', (p) => p.update(12_345, 45_600, started))).toEqual([expect.stringMatching(/^keyfleet: upload 12\.3\/45\.6 KB \(27%\), [\d.]+ KB\/s, ETA \d+s$/)]);
    expect(linesOf('bytes', (p) => p.update(3_200_000, 3_200_000, started))).toEqual([expect.stringMatching(/^keyfleet: upload 3\.2\/3\.2 MB \(100%\), [\d.]+ MB\/s, ETA 0s$/)]);
    expect(linesOf('bytes', (p) => p.update(500_000, 2_500_000_000, started))).toEqual([expect.stringMatching(/^keyfleet: upload 0\.0\/2\.5 GB \(0%\), [\d.]+ KB\/s, ETA \d+s$/)]);
  });

  it('scale a count without a total (a pipe) by the count itself', () => {
    expect(linesOf('bytes', (p) => p.update(12, undefined, Date.now() - 1_000))).toEqual([expect.stringMatching(/^keyfleet: upload 12 B, \d+ B\/s$/)]);
    expect(linesOf('bytes', (p) => p.update(7_500_000, undefined, Date.now() - 10_000))).toEqual([expect.stringMatching(/^keyfleet: upload 7\.5 MB, [\d.]+ KB\/s$/)]);
  });

  it('count items as whole numbers with separators', () => {
    expect(linesOf('items', (p) => p.update(50_000, 50_000, Date.now() - 2_000))).toEqual([expect.stringMatching(/^keyfleet: upload 50,000\/50,000 items \(100%\), [\d,]+ items\/s, ETA 0s$/)]);
  });

  it('measure the rate and ETA from what was done when the count began (a resumed run), not from nothing', () => {
    // 10,000 items in the last 2 s: 5,000/s, and 40,000 left take 8 s (from nothing it would read 30,000/s and 2 s).
    const [line] = linesOf('items', (p) => p.update(60_000, 100_000, Date.now() - 2_000, 50_000));
    const [, rate, eta] = /, ([\d,]+) items\/s, ETA (\d+)s$/.exec(line!)!;
    expect(Number(rate!.replaceAll(',', ''))).toBeGreaterThan(4_000);
    expect(Number(rate!.replaceAll(',', ''))).toBeLessThanOrEqual(5_000);
    expect(Number(eta)).toBeGreaterThanOrEqual(8);
    expect(Number(eta)).toBeLessThan(10);
  });
});
