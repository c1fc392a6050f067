/**
 * Node.js flags the API process runs with, wherever it is started (package.json start:api, the
 * dev runner, the Dockerfile, compose, Kubernetes, tests and the bench; a test checks they agree).
 *
 * --max-semi-space-size=8: V8 sizes the young generation from the machine's memory (16 MB
 * semi-spaces on 24 GB). The sync path's garbage is the requests in flight: with 4 MB they lived
 * through two scavenges and were promoted (GC traces, bench/NOTES.md). At 8 the 10-item p99 was
 * 7–9 ms in three full runs on an Intel host, but the API's 1M-item peak went up with it and 8
 * was reverted (bench/NOTES.md, The Intel host). On an AMD host the API spent 54–63 µs per
 * 10-item request against 67–75 at 4 ad hoc, though full runs there could not tell the two apart.
 * A larger young generation lets dead upload and download Buffers pile up longer between
 * scavenges; reclaim.ts now collects them as they pass. With that, the 1M-item peak was
 * 125–137 MB at 8, against 134–142 at 4 and 144–149 at 8 without it (ad hoc, bench/NOTES.md).
 * On an Intel host of model 167, at 8 with the collections: a 10-item p99 of 8 ms and the API's
 * peak at 128–136 MB in three full runs (bench/NOTES.md, the model-167 host a third time).
 *
 * --expose-gc: gives the API `gc`, which reclaim.ts alone calls.
 */
export const API_NODE_FLAGS: readonly string[] = ['--max-semi-space-size=8', '--expose-gc'];
