import { getHeapStatistics } from 'node:v8';

/**
 * Young collections for the Buffers of large bodies.
 *
 * An upload's socket reads and a download's Redis replies and result lines pass through the API
 * as Buffers that die at once, but their bytes live outside V8's heap, and V8 starts a young
 * collection by how much its heap allocates, which a body in a few large Buffers hardly moves.
 * Left to V8, 30–40 MB of dead Buffers piled up between collections in a 1M-item upload or
 * download (bench/NOTES.md), and the API's peak RSS was its size at rest plus that pile. So
 * every RECLAIM_BYTES of such Buffers passed, one young collection is asked for: about a
 * millisecond, a few dozen times per million items.
 *
 * It needs `gc`, which the API's flags expose (API_NODE_FLAGS); started without it, this does
 * nothing and V8 collects as it would.
 */
export const RECLAIM_BYTES = 8 * 1024 * 1024;

type Collect = (options: { type: 'minor' | 'major'; execution?: 'sync' | 'async' }) => void;
const collect = (globalThis as { gc?: Collect }).gc;

/** The least memory outside the heap seen since the last collection asked for here. */
let floor = Infinity;

/**
 * Called as a large body's Buffers pass: once the memory outside V8's heap (ArrayBuffers,
 * mostly) is RECLAIM_BYTES above the least it has been since the last such call collected,
 * collects the young generation. Reading it costs about half a microsecond.
 */
export function reclaim(): void {
  if (!collect) return;
  const external = getHeapStatistics().external_memory;
  if (external < floor) floor = external;
  if (external - floor < RECLAIM_BYTES) return;
  collect({ type: 'minor' });
  floor = getHeapStatistics().external_memory;
}

/** Passes `pieces` through, reclaiming as they go. */
export async function* reclaiming(pieces: AsyncIterable<Buffer>): AsyncGenerator<Buffer> {
  for await (const piece of pieces) {
    reclaim();
    yield piece;
  }
}
