/**
 * Young collections for the Buffers of large bodies.
 *
 * An upload's socket reads and a download's Redis replies and result lines pass through the API
 * as Buffers that die at once, but their bytes live outside V8's heap, and V8 starts a young
 * collection by how much its heap allocates, which a body in a few large Buffers hardly moves.
 * Left to V8, 35–41 MB of dead Buffers piled up between collections in a 1M-item upload or
 * download, and the API's peak RSS was its size at rest plus that pile (bench/NOTES.md, "Dead
 * Buffers collected as they pass"). So, as a large body's pieces pass, the memory outside the
 * heap (all of the process's, not only the body's) is read, and once it has grown enough above
 * its low point since the last collection asked for here, the young generation is collected.
 *
 * A young collection frees only what is dead. Buffers still in use (a chunk being sent, the
 * next one read ahead) survive it, and after two they are promoted, to be freed only by a full
 * collection, later than V8 would have freed them. Each body in flight holds some, so the growth
 * asked for is RECLAIM_BYTES for each body passing at the time. (With 8 MB whatever the number of
 * bodies, four downloads at once took 277–487 ms against 249–373 without the collections, and
 * the API peaked at 138–163 MB against 145–161; ad hoc, bench/NOTES.md.)
 *
 * It needs `gc`, which the API's flags expose (API_NODE_FLAGS); started without it, this does
 * nothing and V8 collects as it would.
 */

import { getHeapStatistics } from 'node:v8';

/**
 * Each collection asked for here pauses the API: with the 10-item load running through 1M-item
 * batches, 0.9–3.1 ms at the median and 8.4 ms at most (41 collections in three runs on an Intel
 * host). So not too often: on an AMD host, at 8 MB the 10-item p99 during a 1M-item batch was
 * 2.00–2.17× idle in three runs of five, at 16 MB 1.50× and 1.82× in two, and the 1M-item peak
 * 120–129 MB against 125–137 (bench/NOTES.md).
 */
export const RECLAIM_BYTES = 16 * 1024 * 1024;

const collect = (globalThis as { gc?: (options: { type: 'minor' }) => void }).gc;

/** The least memory outside the heap seen since the last collection asked for here. */
let floor = Infinity;
/** Bodies passing through `reclaiming` now. */
let passing = 0;

/**
 * Called as a large body's Buffers pass (so `passing` is at least 1): collects the young
 * generation once the memory outside V8's heap has grown RECLAIM_BYTES for each body passing
 * above its low point. Reading it costs about half a microsecond.
 */
function reclaim(): void {
  if (!collect) return;
  const external = getHeapStatistics().external_memory;
  if (external < floor) floor = external;
  if (external - floor < RECLAIM_BYTES * passing) return;
  collect({ type: 'minor' });
  // Its frees are swept on another thread and counted off some pieces later: the floor starts
  // over from the readings after them, not from one taken at once.
  floor = Infinity;
}

/** For tests: how many bodies `reclaiming` is passing now. */
export const bodiesPassing = (): number => passing;

/** Passes `pieces` through, reclaiming as they go. */
export async function* reclaiming(pieces: AsyncIterable<Buffer>): AsyncGenerator<Buffer> {
  passing++;
  try {
    for await (const piece of pieces) {
      reclaim();
      yield piece;
    }
  } finally {
    passing--;
  }
}
