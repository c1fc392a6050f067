/**
 * Node.js flags the API process runs with, wherever it is started (package.json start:api, the
 * dev runner, the Dockerfile, compose, Kubernetes, tests and the bench; a test checks they agree).
 *
 * --max-semi-space-size=8: V8 sizes the young generation from the machine's memory (16 MB
 * semi-spaces on 24 GB). The sync path's garbage is the requests in flight: in a smaller young
 * generation they outlive two scavenges and are promoted, and the API spent more CPU per
 * 10-item request at 4 MB than at 8 (ad hoc, three alternating pairs on the AMD family-25 host:
 * 66.8–75.0 µs against 53.8–63.4; bench/NOTES.md). A larger one lets dead upload and download
 * Buffers pile up between scavenges; reclaim.ts collects them as they pass, for which
 *
 * --expose-gc: gives the API `gc`, called by reclaim.ts alone. 1M-item run, API peak RSS (ad
 * hoc): 134–141 MB at 4 MB without it, 144–149 MB at 8 without, 119–129 MB at 8 with it.
 */
export const API_NODE_FLAGS: readonly string[] = ['--max-semi-space-size=8', '--expose-gc'];
