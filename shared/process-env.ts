/**
 * Environment every keyfleet process (API and worker) starts with, wherever it is started: the
 * package.json start scripts, the image (Dockerfile `ENV`, which compose and Kubernetes inherit),
 * the dev runner, the bench and the tests. A test checks they agree. Values an operator sets
 * win over these in the dev runner, the bench and the tests; the start scripts and the image
 * set them outright.
 *
 * GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072: glibc serves blocks of 128 KiB and more
 * with mmap, but raises that threshold (up to 32 MiB) each time such a block is freed. After
 * the first chunk, the chunk-sized buffers of a batch (0.3–1.2 MB: uploads, sealed chunks,
 * results) come from the malloc heap instead, and what is freed there mostly stays resident.
 * A fixed threshold hands every freed large buffer back to the kernel. Measured on a 1M-item
 * batch (bench: e2e peak RSS): API 155–163 MB instead of 164–185 MB, worker 198–209 MB instead
 * of 221–247 MB, no change in throughput. Other C libraries ignore the variable.
 */
export const PROCESS_ENV: Readonly<Record<string, string>> = {
  GLIBC_TUNABLES: 'glibc.malloc.mmap_threshold=131072',
};
