import { randomBytes } from 'node:crypto';
import { makeItems, naiveEncrypt, timeMs } from './naive.js';
import type { Row } from './report.js';
import { call, downloadResults, peakRssMb, startStack, uploadBatch, waitForBatch } from './stack.js';

/**
 * End to end: n items of 32 bytes uploaded as NDJSON → batch → one worker process (threads =
 * cores) → results fully downloaded. Compared with the naive loop over the same items.
 */
export async function e2eBench(n: number, env: Record<string, string> = {}, label = ''): Promise<Row[]> {
  const { body, naiveMs } = reference(n);

  const stack = await startStack(env);
  try {
    await call(stack, 'POST', '/v1/keys/bench');
    // A small batch first, so connections, scripts and threads are warm.
    await waitForBatch(stack, await uploadBatch(stack, 'op=encrypt&key=bench', '"warm"\n'));

    const cpuBefore = await stack.redisCpuSeconds();
    const start = process.hrtime.bigint();
    const batchId = await uploadBatch(stack, 'op=encrypt&key=bench', body);
    const uploadedMs = Number(process.hrtime.bigint() - start) / 1e6;
    const status = await waitForBatch(stack, batchId);
    const processedMs = Number(process.hrtime.bigint() - start) / 1e6;
    const { lines } = await downloadResults(stack, batchId);
    const wallMs = Number(process.hrtime.bigint() - start) / 1e6;
    const redisCpuMs = ((await stack.redisCpuSeconds()) - cpuBefore) * 1000;
    if (status.succeeded !== n || lines !== n) throw new Error(`e2e: expected ${n} results, got ${status.succeeded} succeeded and ${lines} lines`);

    const per = (ms: number) => ms * (1_000_000 / n);
    return [
      { section: 'end to end', name: `naive per-item loop over the same ${n.toLocaleString('en-US')} items, one thread (reference)`, value: naiveMs, unit: 'ms', reference: naiveMs, ratio: 1 },
      { section: 'end to end', name: `upload → batch → 1 worker → results downloaded${label}`, value: wallMs, unit: 'ms', reference: naiveMs, ratio: naiveMs / wallMs, note: `upload ${Math.round(uploadedMs)} ms, done at ${Math.round(processedMs)} ms` },
      { section: 'end to end', name: 'throughput', value: n / (wallMs / 1000), unit: 'items/s', reference: n / (naiveMs / 1000), ratio: naiveMs / wallMs },
      { section: 'end to end', name: 'peak RSS, API', value: peakRssMb(stack.api.pid!), unit: 'MB' },
      { section: 'end to end', name: 'peak RSS, worker', value: peakRssMb(stack.worker.pid!), unit: 'MB' },
      { section: 'end to end', name: 'Redis CPU per million items', value: per(redisCpuMs), unit: 'ms' },
    ];
  } finally {
    await stack.stop();
  }
}

/**
 * The upload body and the naive loop's time over the same items. The item strings go out of
 * scope here, so the bench process, which is also the HTTP client, does not carry them through
 * the run (ad hoc, on Node 24 with fetch as the client: with them held, the results took
 * 879–1,302 ms to read, against 420–431 ms for curl).
 */
function reference(n: number): { body: Buffer; naiveMs: number } {
  const items = makeItems(n, 'e2e');
  return {
    body: Buffer.from(items.map((s) => `"${s}"`).join('\n') + '\n'),
    naiveMs: timeMs(() => naiveEncrypt(items, randomBytes(32), Buffer.from('kf:bench:v1'))),
  };
}
