import { move } from 'piscina';
import { runChunkInto } from '../shared/crypto/kernel.js';
import { KeyRing } from '../shared/crypto/key-ring.js';
import { NonceSource } from '../shared/crypto/nonces.js';
import { lowerThreadPriority } from '../shared/priority.js';
import { RESULT_HEADER_BYTES, writeResultHeader, type ThreadTask } from './messages.js';

// Runs inside a worker thread: one chunk per task, crypto on buffers, off the worker's event loop.
const nonces = new NonceSource();
let niced = false;

export default function runTask(task: ThreadTask): Uint8Array {
  const started = performance.now();
  if (!niced) {
    niced = true;
    // The worker process has set its own threads already (worker/main.ts), and threads inherit
    // it; this covers a pool started in another process (tests). Where lowering is refused,
    // the thread keeps the priority it inherited.
    lowerThreadPriority(0, task.priority);
  }
  const ring = new KeyRing(task.ring);
  const target = task.target ? new KeyRing(task.target) : undefined;
  const out = runChunkInto(task.job, task.input, ring, RESULT_HEADER_BYTES, task.kernel, nonces, target);
  const { count, succeeded, failed, newerVersionSeen } = out;
  writeResultHeader(out.buffer, { count, succeeded, failed, newerVersionSeen, busyMs: performance.now() - started });
  return move(out.buffer) as Uint8Array;
}
