/**
 * Node.js flags the API process runs with, wherever it is started (package.json start:api, the
 * dev runner, the Dockerfile, compose, Kubernetes, tests and the bench; a test checks they agree).
 *
 * --max-semi-space-size=4: V8 sizes the young generation from the machine's memory (16 MB
 * semi-spaces on 24 GB); the API's garbage is short-lived request and upload buffers, and a
 * 4 MB young generation keeps its peak RSS through a 1M-item upload near 140 MB instead of
 * 210 MB (bench: e2e peak RSS). On a slow host that cost no measurable requests/s; on a fast one
 * it costs the sync path 9–14% and a few ms of p99, and 8 MB was tried and reverted
 * (bench/NOTES.md, The Intel host).
 */
export const API_NODE_FLAGS: readonly string[] = ['--max-semi-space-size=4'];
