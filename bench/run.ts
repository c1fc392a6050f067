/**
 * `npm run bench [-- --quick]`: the benchmark suite. Every figure is paired with a reference
 * measured in the same run and reported as a ratio (machines are shared and noisy: compare
 * ratios, not absolute numbers across runs). Prints a table and writes bench/results/*.json.
 */
import { mkdirSync, writeFileSync } from 'node:fs';
import { availableParallelism, cpus, totalmem } from 'node:os';
import { join, resolve } from 'node:path';
import { crossoverBench } from './crossover.js';
import { e2eBench } from './e2e.js';
import { kernelBench } from './kernel.js';
import { printTable, type Row } from './report.js';
import { isolationAb, isolationBench, syncBench } from './sync.js';

const quick = process.argv.includes('--quick');
const only = process.argv.find((a) => a.startsWith('--only='))?.slice(7).split(',');
const want = (section: string) => !only || only.includes(section);

const rows: Row[] = [];
const started = Date.now();
if (want('kernel')) rows.push(...kernelBench(quick ? 200_000 : 1_000_000, quick ? 1 : 3));
if (want('e2e')) rows.push(...(await e2eBench(quick ? 200_000 : 1_000_000)));
if (want('chunks') && !quick) {
  // CHUNK_ITEMS: the same million in smaller and larger chunks (only the timing rows).
  for (const chunk of [2_500, 40_000]) {
    const rows2 = await e2eBench(1_000_000, { CHUNK_ITEMS: String(chunk) }, ` with CHUNK_ITEMS=${chunk.toLocaleString('en-US')}`);
    rows.push(...rows2.filter((r) => r.name.startsWith('upload') || r.name.startsWith('Redis')).map((r) => (r.name.startsWith('Redis') ? { ...r, name: `${r.name} with CHUNK_ITEMS=${chunk.toLocaleString('en-US')}` } : r)));
  }
}
if (want('sync')) rows.push(...(await syncBench(quick ? 3 : 4, quick ? 1 : 3)));
// The worker's default scheduling (SCHED_IDLE, nice 19); in the full run also niceness alone, 19 and 0.
const SCHED_DEFAULT = { nice: 19, sched: 'idle' } as const;
const NICE_19 = { nice: 19, sched: 'normal' } as const;
if (want('isolation')) {
  for (const scheduling of quick ? [SCHED_DEFAULT] : [SCHED_DEFAULT, NICE_19, { nice: 0, sched: 'normal' } as const]) {
    rows.push(...(await isolationBench(quick ? 3 : 8, quick ? 200_000 : 1_000_000, scheduling)));
  }
}
// Not in the default run (about 3 minutes): SCHED_IDLE against nice 19 alone, round by round.
if (only?.includes('isolation-ab')) rows.push(...(await isolationAb(quick ? 2 : 6, 3, quick ? 200_000 : 1_000_000, SCHED_DEFAULT, NICE_19)));
if (want('crossover')) {
  const { rows: crossover, syncFasterUpTo } = await crossoverBench(quick ? [10, 100, 1_000, 10_000] : [10, 100, 1_000, 10_000, 100_000], quick ? 3 : 5);
  rows.push(...crossover, { section: 'crossover', name: 'largest N where sync was faster', value: syncFasterUpTo, unit: 'items' });
}

const machine = { cpu: cpus()[0]?.model ?? 'unknown', cores: availableParallelism(), memoryGb: Math.round(totalmem() / 2 ** 30), node: process.version };
console.log(`keyfleet bench (${quick ? 'quick' : 'full'}) on ${machine.cores} × ${machine.cpu}, ${machine.memoryGb} GB, Node ${machine.node}, ${Math.round((Date.now() - started) / 1000)} s\n`);
console.log(printTable(rows));
const dir = resolve(import.meta.dirname, '..', '..', 'bench', 'results');
mkdirSync(dir, { recursive: true });
const file = join(dir, `${new Date().toISOString().replace(/[:.]/g, '-')}${quick ? '-quick' : ''}.json`);
writeFileSync(file, JSON.stringify({ date: new Date().toISOString(), quick, machine, rows }, null, 2) + '\n');
console.log(`\nwritten: ${file}`);
