import { createRequire } from 'node:module';
import { CATALOGUE, type ErrorCode } from '../errors.js';
import { projectRoot } from '../project-root.js';
import type { NativeVersionEntry as NativeVersion } from './key-ring.js';

export type { NativeVersionEntry as NativeVersion } from './key-ring.js';

/** The addon in native/kernel.c: one call per chunk over OpenSSL EVP. */
interface NativeAddon {
  setErrors(errors: string[]): void;
  run(params: Uint32Array, versions: readonly NativeVersion[], input: Uint8Array, output: Uint8Array): [written: number, count: number, succeeded: number, failed: number, newerVersionSeen: boolean];
  /**
   * Packs the plain-string lines of an NDJSON piece as chunk items (the fast path of
   * producer/ndjson-items.ts). `state` is [start, end, outAt, maxItems, maxItemBytes] in and
   * [.., .., outAt, .., .., items, next, reason] out; reason 0 = done, 1 = a line it leaves to
   * JavaScript starts at `next`, 2 = maxItems packed.
   */
  packLines(src: Uint8Array, out: Uint8Array, state: Uint32Array): void;
  /** Linux's SCHED_IDLE policy for a thread (0: the calling one); 0, or the errno. */
  setIdleScheduling(thread: number): number;
}

/** A call's scalars, [op, base64Out, base64In, sync, firstIndex, maxItemBytes, latest, minDecryptionVersion], and the key versions. */
export interface NativeJob {
  readonly params: Uint32Array;
  readonly versions: readonly NativeVersion[];
}

// The order the addon indexes its error table by.
const ERROR_ORDER: readonly ErrorCode[] = ['KF_INVALID_ITEM', 'KF_ITEM_TOO_LARGE', 'KF_DECRYPT_FAILED', 'KF_KEY_VERSION_DISABLED', 'KF_NOT_UTF8', 'KF_INVALID_ENCODING'];

function load(): { addon?: NativeAddon; reason?: string } {
  const root = projectRoot();
  if (!root) return { reason: 'binding.gyp not found' };
  try {
    // node-gyp-build finds build/Release (or a prebuild) the way native packages do.
    const nodeGypBuild = createRequire(import.meta.url)('node-gyp-build') as (dir: string) => NativeAddon;
    const addon = nodeGypBuild(root);
    addon.setErrors(ERROR_ORDER.map((code) => JSON.stringify({ code, message: CATALOGUE[code].message })));
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
