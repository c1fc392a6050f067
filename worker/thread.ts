import { move } from 'piscina';
import { runChunk } from '../shared/crypto/chunk-kernel.js';
import { KeyRing } from '../shared/crypto/key-ring.js';
import { NonceSource } from '../shared/crypto/nonces.js';
import { encodeResult, type ThreadTask } from './messages.js';

// Runs inside a worker thread: one chunk per task, crypto on buffers, off the worker's event loop.
const nonces = new NonceSource();

export default function runTask(task: ThreadTask): Uint8Array {
  const ring = new KeyRing(task.ring);
  const input = Buffer.from(task.input.buffer, task.input.byteOffset, task.input.byteLength);
  const out = runChunk(task.job, input, ring, nonces);
  return move(encodeResult(out.lines, out.count, out.succeeded, out.failed, out.newerVersionSeen)) as Uint8Array;
}
