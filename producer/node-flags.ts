/**
 * Node.js flags the API process runs with, wherever it is started (package.json start:api, the
 * dev runner, the Dockerfile, compose, Kubernetes, tests and the bench; a test checks they agree).
 *
 * --max-semi-space-size=4: V8 sizes the young generation from the machine's memory (16 MB
 * semi-spaces on 24 GB); the API's garbage is short-lived request and upload buffers, and a
 * 4 MB young generation keeps its peak RSS through a 1M-item upload near 140 MB instead of
 * 210 MB (bench: e2e peak RSS), at no measurable cost in requests/s.
 */
export const API_NODE_FLAGS: readonly string[] = ['--max-semi-space-size=4'];
