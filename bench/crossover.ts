import { makeItems } from './naive.js';
import { median, type Row } from './report.js';
import { call, downloadResults, send, startStack, uploadBatch, waitForBatch, type Stack } from './stack.js';

async function timed(fn: () => Promise<void>, reps: number): Promise<number> {
  const runs: number[] = [];
  for (let r = 0; r < reps; r++) {
    const start = process.hrtime.bigint();
    await fn();
    runs.push(Number(process.hrtime.bigint() - start) / 1e6);
  }
  return median(runs);
}

/** Latency of N items through the sync path vs through a batch (upload, process, download). */
export async function crossoverBench(sizes: readonly number[], reps: number): Promise<{ rows: Row[]; syncFasterUpTo: number }> {
  const stack: Stack = await startStack({ SYNC_MAX_ITEMS: '100000', MAX_BODY_BYTES: String(64 * 1024 * 1024) });
  const rows: Row[] = [];
  let syncFasterUpTo = 0;
  try {
    await call(stack, 'POST', '/v1/keys/bench');
    for (const n of sizes) {
      const items = makeItems(n, 'x');
      const json = JSON.stringify({ items, mode: 'sync' });
      const ndjson = items.map((s) => `"${s}"`).join('\n') + '\n';
      const sync = await timed(async () => {
        const status = await send(stack, 'POST', '/v1/encrypt/bench', { type: 'application/json', bytes: json }, () => {});
        if (status !== 200) throw new Error(`crossover: sync ${n} items answered ${status}`);
      }, reps);
      const async = await timed(async () => {
        const batchId = await uploadBatch(stack, 'op=encrypt&key=bench', ndjson);
        await waitForBatch(stack, batchId);
        await downloadResults(stack, batchId);
      }, reps);
      if (sync <= async) syncFasterUpTo = n;
      rows.push({ section: 'crossover', name: `${n.toLocaleString('en-US')} items: sync vs batch`, value: sync, unit: 'ms (sync)', reference: async, ratio: sync / async, note: `batch ${async.toFixed(1)} ms` });
    }
  } finally {
    await stack.stop();
  }
  return { rows, syncFasterUpTo };
}
