/**
 * Node.js flags the API process runs with, wherever it is started (package.json start:api, the
 * dev runner, the Dockerfile, compose, Kubernetes, tests and the bench; a test checks they agree).
 *
 * --max-semi-space-size=8: V8 sizes the young generation from the machine's memory (16 MB
 * semi-spaces on 24 GB); the API's garbage is short-lived request and upload buffers. 8 MB is
 * the trade between the sync path and peak RSS (bench/NOTES.md, The Intel host): against 4 MB
 * it answered 10-item encrypts 9–14% faster with a p99 of 7 ms instead of 8–10 (the target is
 * 10), at 174–191 MB of peak RSS through a 1M-item run instead of 166–167; 16 MB gave the sync
 * path no more, and took the upload's peak to ~210 MB.
 */
export const API_NODE_FLAGS: readonly string[] = ['--max-semi-space-size=8'];
