import { createRequire } from 'node:module';
import { projectRoot } from '../project-root.js';
import { RESULT_ERROR_JSON, type NativeFormatter } from '../result-codec.js';

/** The addon in native/kernel.c: one call per chunk over OpenSSL EVP. */
interface NativeAddon extends NativeFormatter {
  setErrors(errors: string[]): void;
  /** `versions`: the key's versions as packVersions (key-ring.ts) lays them out. */
  run(params: Uint32Array, versions: Uint8Array, input: Uint8Array, output: Uint8Array): [written: number, count: number, succeeded: number, failed: number, newerVersionSeen: boolean];
  /**
   * Packs the plain-string lines of an NDJSON piece as chunk items (the fast path of
   * producer/ndjson-items.ts). `state` is [start, end, outAt, maxItems, maxItemBytes] in and
   * [.., .., outAt, .., .., items, next, reason] out; reason 0 = done, 1 = a line it leaves to
   * JavaScript starts at `next`, 2 = maxItems packed.
   */
  packLines(src: Uint8Array, out: Uint8Array, state: Uint32Array): void;
  /** Linux's SCHED_IDLE policy for a thread (0: the calling one); 0, or the errno. */
  setIdleScheduling(thread: number): number;
  /** shared/tokens.ts's DigestMatcher, with SHA-256 fetched from OpenSSL once rather than per call. */
  tokenIndex(token: string, digests: Uint8Array): number;
}

/** A call's scalars, [op, base64Out, base64In, json, maxItemBytes, latest, minDecryptionVersion], and the key versions. */
export interface NativeJob {
  readonly params: Uint32Array;
  /** Packed: key-ring.ts's packVersions. */
  readonly versions: Uint8Array;
}

function load(): { addon?: NativeAddon; reason?: string } {
  const root = projectRoot();
  if (!root) return { reason: 'binding.gyp not found' };
  try {
    // node-gyp-build finds build/Release (or a prebuild) the way native packages do.
    const nodeGypBuild = createRequire(import.meta.url)('node-gyp-build') as (dir: string) => NativeAddon;
    const addon = nodeGypBuild(root);
    addon.setErrors([...RESULT_ERROR_JSON]);
    return { addon };
  } catch (err) {
    return { reason: (err as Error).message.split('\n')[0] };
  }
}

const loaded = load();

/** The native kernel, or undefined where it was not built (the node:crypto kernel takes over). */
export const nativeKernel: NativeAddon | undefined = loaded.addon;
/** Why the native kernel is not in use, for the startup log. */
export const nativeKernelUnavailable: string | undefined = loaded.reason;
