import { randomUUID } from 'node:crypto';
import { createWriteStream, fstatSync, statSync, unlinkSync, type WriteStream } from 'node:fs';
import { open, stat, truncate } from 'node:fs/promises';
import { once } from 'node:events';
import { finished } from 'node:stream/promises';
import { setTimeout as sleep } from 'node:timers/promises';
import { TERMINAL_STATUSES, type BatchOp, type BatchStatusBody } from '../shared/schemas.js';
import type { KeyfleetClient } from './client.js';
import { KeyfleetApiError, KeyfleetTimeoutError } from './errors.js';
import { inputName, LineMap, NotUtf8Error, READ_END, readLines, resumePoint, STDIN } from './lines.js';
import { Progress } from './progress.js';
import { GATEWAY_ANSWERS } from './retry.js';

export interface BulkOptions {
  readonly op: BatchOp;
  readonly key: string;
  readonly in?: string;
  readonly out: string;
  /** Lines are JSON strings (NDJSON) rather than raw text. */
  readonly ndjson: boolean;
  readonly encoding?: 'utf8' | 'base64';
  /** Skip the upload: wait for this batch and download its results (appending to `out`). */
  readonly resume?: string;
  /** The upload's Idempotency-Key; without one, a key of its own, named in the messages that need it. */
  readonly idempotencyKey?: string;
  readonly callbackUrl?: string;
  readonly context?: string;
  readonly targetKey?: string;
  /** Where messages go (stderr). */
  readonly log: (line: string) => void;
  /** Told the batch's id once the service accepts the upload (not called with `resume`). */
  readonly onAccepted?: (batchId: string) => void;
  /**
   * Told the upload's Idempotency-Key once an upload has been handed over whole: from then on
   * the service may make the batch, whatever becomes of its answer, and only that key gets the
   * same batch rather than a second one.
   */
  readonly onSentWhole?: (idempotencyKey: string) => void;
  readonly interactive?: boolean;
  /** How long a batch may go without an item processed before the run says so (default 30 s; the CLI passes --timeout). */
  readonly stallNoticeMs?: number;
}

export interface BulkOutcome {
  readonly batchId: string;
  readonly total: number;
  readonly succeeded: number;
  /** Items whose line is empty (null with --ndjson): failed, not writable as a line, or never processed. */
  readonly failed: number;
  /**
   * `completed`, or `failed` for a batch that failed after its upload: the results of its chunks
   * that ran are written all the same (a batch that failed during its upload throws).
   */
  readonly status: 'completed' | 'failed';
  /** Why the batch failed, if it did. */
  readonly error?: { readonly code: string; readonly message: string };
  /** Items of the chunks a failed batch never ran (their lines are KF_ITEM_NOT_PROCESSED, not listed one by one). */
  readonly notProcessed: number;
  /**
   * With --resume: the output lines an earlier run had written. Their failures were listed by
   * that run, and a plaintext among them that held a line break is counted here as succeeded.
   */
  readonly resumedAfterLine?: number;
}

const NOT_PROCESSED = 'KF_ITEM_NOT_PROCESSED';
const STALL_NOTICE_MS = 30_000;

/** Per-item errors printed in full; after that only counted. */
const ERRORS_SHOWN = 100;
const DOWNLOAD_ATTEMPTS = 6;
const BLANK_LINE = /^[ \t]*\r?$/;

/**
 * A file through a batch: stream its lines up as NDJSON, follow the batch's progress, then write
 * one result per input line, in order, to `out`. A download cut short resumes where the file
 * ends; `resume` picks a batch up again after the CLI itself was interrupted.
 */
export async function runBulk(client: KeyfleetClient, options: BulkOptions): Promise<BulkOutcome> {
  if (!options.resume && !options.in) throw new Error('--in FILE is required (or --resume BATCH_ID)');
  // Opened first, without truncating it (it may be the input): a path that cannot be written
  // fails now, not after the whole batch has run. A file made here goes again if the run fails
  // or is interrupted (Ctrl-C ends the process) before writing to it; what a failed download
  // wrote stays, for --resume.
  const found = await stat(options.out).catch(() => undefined);
  // (Not a named pipe or a device: opening and closing one would end its reader's input.)
  if (!found || !(found.isFIFO() || found.isCharacterDevice() || found.isSocket())) {
    const opened = await open(options.out, 'a').catch((err: unknown) => Promise.reject(cannotWrite(`--out ${options.out}`, err, OPEN_REASONS)));
    await opened.close();
  }
  const dropIfEmpty = (): void => {
    try {
      if (statSync(options.out).size === 0) unlinkSync(options.out);
    } catch {
      // gone already
    }
  };
  if (!found) process.once('exit', dropIfEmpty);
  try {
    return await bulk(client, options);
  } catch (err) {
    if (!found) dropIfEmpty();
    throw err;
  } finally {
    process.off('exit', dropIfEmpty);
  }
}

async function bulk(client: KeyfleetClient, options: BulkOptions): Promise<BulkOutcome> {
  const { op, key, log } = options;
  const lines = new LineMap();
  let batchId = options.resume;
  if (!batchId) {
    const input = options.in!;
    // stdin: a file redirected to it has its size (for the progress bar), but is read only once.
    const file = input === STDIN ? fstatSync(0) : await stat(input).catch((err: NodeJS.ErrnoException) => Promise.reject(new Error(`cannot read --in ${input} (${err.code ?? err.message})`, { cause: err })));
    if (file.isDirectory()) throw new Error(`cannot read --in ${input}: it is a directory`);
    const readTwice = input !== STDIN && file.isFile();
    // An empty file has no items: its output is empty too, and no batch is made (the service
    // refuses an upload of none, and would keep it as a failed batch).
    if (readTwice && file.size === 0) {
      if ((await stat(options.out)).isFile()) await truncate(options.out, 0);
      return { batchId: '', total: 0, succeeded: 0, failed: 0, status: 'completed', notProcessed: 0 };
    }
    // A pipe's size is unknown (0): its progress shows what was read, without a total.
    const size = file.isFile() ? file.size : undefined;
    let uploads = 0;
    const upload = new Progress('keyfleet: upload', 'bytes', options.interactive);
    const started = Date.now();
    // The CLI's own key, unless given one: the client would make one too, but the user needs to
    // know it to run the command again without making a second batch.
    const idempotencyKey = options.idempotencyKey ?? randomUUID();
    const sameBatch = rerunWith(idempotencyKey);
    const accepted = await stoppedAfter(upload, client.createBatchFromNdjson(
      {
        op, key, idempotencyKey,
        ...(options.encoding ? { encoding: options.encoding } : {}),
        ...(options.callbackUrl ? { callbackUrl: options.callbackUrl } : {}),
        ...(options.context !== undefined ? { context: options.context } : {}),
        ...(options.targetKey ? { targetKey: options.targetKey } : {}),
      },
      () => {
        // The upload must be sent again (a 429 or 503, a timeout): a pipe cannot be read twice.
        if (uploads++ > 0 && !readTwice) throw new Error(`the upload must be sent again, and ${inputName(input)} is not a file that can be read twice: save the input to a file and run again with --idempotency-key ${idempotencyKey} (the service may have made the batch of the first upload; the key gets that one rather than a second)`);
        return wholeThen(ndjsonPieces(input, options.ndjson, op !== 'encrypt', lines, (read) => upload.update(read, size, started), { eager: size === undefined }), () => options.onSentWhole?.(idempotencyKey));
      },
    )).catch((err: unknown) => {
      // The service may have made the batch and its answer was lost: only the key gets that one.
      if (err instanceof KeyfleetTimeoutError && err.maybeDone) throw new Error(`${err.call}: ${err.waited}; the service may have made the batch: ${sameBatch}`, { cause: err });
      if (err instanceof KeyfleetApiError && err.code === 'KF_IDEMPOTENCY_IN_PROGRESS') throw new Error(`the service still takes in the upload sent before (KF_IDEMPOTENCY_IN_PROGRESS) and may make the batch: ${sameBatch}; an upload cut short holds its key for a while (two minutes under the service’s defaults), so a rerun sooner may get this answer again`, { cause: err });
      throw err;
    });
    batchId = accepted.batchId;
    options.onAccepted?.(batchId);
    // A key of the user's own may have made its batch in an earlier run: this run then follows that one.
    const earlier = accepted.replayed && options.idempotencyKey ? `, made earlier under --idempotency-key ${options.idempotencyKey}` : '';
    log(`keyfleet: batch ${batchId} accepted${earlier}, ${accepted.total.toLocaleString('en-US')} items (interrupted? resume with ${resumeWith(options, batchId)})`);
  } else {
    // Before waiting on it or reading the input: a batch of another op or key is refused at
    // once, not once it has ended (a batch's op and key never change; one just made is ours).
    sameWork(await client.batch(batchId), op, key);
    if (options.in && options.ndjson) for await (const _ of ndjsonPieces(options.in, true, op !== 'encrypt', lines));
  }

  const progress = new Progress(`keyfleet: ${op}`, 'items', options.interactive);
  const watch = new StallWatch(batchId, options, progress);
  const final = await stoppedAfter(progress, client.waitForBatch(batchId, (status) => watch.seen(status), { apiReached: !options.resume }).finally(() => watch.stop()));
  const ended = `batch ${batchId} ended ${final.status}${final.error ? `: ${final.error.code} ${final.error.message}` : ''}`;
  if (final.status !== 'completed' && final.status !== 'failed') throw new Error(ended);
  // A batch that failed after its upload has the results of the chunks that ran: they are
  // written, and the lines of the items it never processed are left empty. One that failed
  // during its upload has none (KF_BATCH_FAILED).
  const { written, unwritable, resumedAfterLine } = await download(client, batchId, options, lines).catch((err: unknown) => {
    throw err instanceof KeyfleetApiError && err.code === 'KF_BATCH_FAILED' ? new Error(ended, { cause: err }) : err;
  });
  if (written !== final.total) throw new Error(`batch ${batchId}: wrote ${written} results for ${final.total} items`);
  const succeeded = final.succeeded - unwritable;
  return { batchId, total: final.total, succeeded, failed: final.total - succeeded, status: final.status, ...(final.error ? { error: final.error } : {}), notProcessed: final.total - final.processed, ...(resumedAfterLine ? { resumedAfterLine } : {}) };
}

/**
 * Follows a batch's progress for the bar, and says so once when no item has been processed for
 * `stallNoticeMs` (a batch waits with no worker running, or one stuck): the wait goes on, and the
 * message says what it waits for and how to leave it. Said again after each new stall.
 */
class StallWatch {
  readonly #timer: NodeJS.Timeout;
  #last: BatchStatusBody | undefined;
  #movedAt = Date.now();
  #told = false;
  /** Where this run's rate is measured from: the batch's creation, or for --resume the first status seen. */
  #from: { at: number; done: number } | undefined;

  constructor(readonly batchId: string, readonly options: BulkOptions, readonly progress: Progress) {
    const after = options.stallNoticeMs ?? STALL_NOTICE_MS;
    this.#timer = setInterval(() => this.#check(after), Math.min(after, 1_000)).unref();
  }

  seen(status: BatchStatusBody): void {
    // A resumed run's rate is its own (measured from the batch's creation it would count the
    // time the CLI was away), unless the batch has ended: then it is the whole batch's.
    this.#from ??= this.options.resume && !TERMINAL_STATUSES.has(status.status) ? { at: Date.now(), done: status.processed } : { at: Date.parse(status.createdAt), done: 0 };
    if (!this.#last || status.processed > this.#last.processed) {
      this.#movedAt = Date.now();
      this.#told = false;
    }
    this.#last = status;
    this.progress.update(status.processed, status.total, this.#from.at, this.#from.done);
  }

  stop(): void {
    clearInterval(this.#timer);
  }

  #check(after: number): void {
    const status = this.#last;
    if (this.#told || !status || TERMINAL_STATUSES.has(status.status) || Date.now() - this.#movedAt < after) return;
    this.#told = true;
    const done = `${status.processed.toLocaleString('en-US')} of ${status.total.toLocaleString('en-US')} items processed`;
    this.progress.note(`keyfleet: batch ${this.batchId} is ${status.status}, ${done}, none in the last ${Math.round(after / 1000)} s: its chunks wait for a worker (is one running?). Still waiting; Ctrl-C leaves the batch to resume with ${resumeWith(this.options, this.batchId)}`);
  }
}

/** Refuses a batch of another operation or key than the command's (a --resume of the wrong id). */
function sameWork(batch: BatchStatusBody, op: BatchOp, key: string): void {
  if (batch.op !== op || batch.key !== key) throw new Error(`batch ${batch.id} is ${batch.op} under key ${batch.key}, not ${op} under key ${key}`);
}

/** `work`, with `bar` stopped when it settles either way: a bar left running holds the process open. */
async function stoppedAfter<T>(bar: Progress, work: Promise<T>): Promise<T> {
  try {
    return await work;
  } finally {
    bar.stop();
  }
}

/** What the CLI tells of an upload the service may have made into a batch: how to get that one. */
export const rerunWith = (idempotencyKey: string): string => `run the same command again with --idempotency-key ${idempotencyKey} to get it rather than a second one`;

/** `pieces`, then `whole()` once the last has been taken. */
async function* wholeThen<T>(pieces: AsyncIterable<T>, whole: () => void): AsyncGenerator<T> {
  yield* pieces;
  whole();
}

/**
 * The input as NDJSON pieces of about 256 KB; plain lines become JSON strings. Ciphertext lines
 * (decrypt, rewrap) lose a trailing `\r` and the file's byte order mark, which no ciphertext
 * holds: a file saved with Windows line ends decrypts as it is. Plaintext lines are kept whole.
 */
async function* ndjsonPieces(path: string, ndjson: boolean, ciphertexts: boolean, lines: LineMap, onBytes?: (read: number) => void, { eager = false } = {}): AsyncGenerator<string> {
  lines.reset();
  let piece = '';
  let lineNo = 0;
  try {
    for await (const read of readLines(path, onBytes)) {
      if (read === READ_END) {
        // From a pipe, what its writer wrote goes on now, rather than at 256 KB: a slow writer's
        // upload starts (and is refused, if it is refused) with its first lines.
        if (eager && piece) {
          yield piece;
          piece = '';
        }
        continue;
      }
      lineNo++;
      let line = read;
      if (ciphertexts && !ndjson) {
        if (lineNo === 1 && line.startsWith('\ufeff')) line = line.slice(1);
        if (line.endsWith('\r')) line = line.slice(0, -1);
      }
      if (ndjson) {
        // The API skips blank NDJSON lines: spaces and tabs, with a line end's CR (producer/
        // ndjson-items.ts). Not what trim() takes as blank: a no-break space or a form feed is
        // an item to the API (it fails), and skipping it here would shift every line number after.
        if (BLANK_LINE.test(line)) continue;
        piece += line + '\n';
      } else {
        piece += JSON.stringify(line) + '\n';
      }
      lines.push(lineNo);
      if (piece.length >= 262_144) {
        yield piece;
        piece = '';
      }
    }
  } catch (err) {
    if (!(err instanceof NotUtf8Error)) throw err;
    const advice = ciphertexts ? 'no ciphertext holds such bytes: the file is damaged' : 'give such items as base64 in an NDJSON file (--ndjson --encoding base64)';
    throw new Error(`${err.message}; ${advice}`);
  }
  lines.total = lineNo;
  if (piece) yield piece;
}

/**
 * Writes the results to `out` from where it ends, retrying a broken download from there. A
 * failed item is reported once, however often its part is read. So is a plaintext that holds a
 * line break, which one line of a plain output file cannot: its line is left empty, and it
 * counts as failed (`unwritable`); --ndjson keeps it. A blank line of an NDJSON input (no item)
 * is a blank line of the output, so that output line n answers input line n.
 */
async function download(client: KeyfleetClient, batchId: string, options: BulkOptions, lines: LineMap): Promise<{ written: number; unwritable: number; resumedAfterLine: number }> {
  let unwritable = 0;
  // Lines on disk, blank ones included, and the items they hold.
  let linesWritten = options.resume ? await resumePoint(options.out) : 0;
  const resumedAfterLine = linesWritten;
  let written = lines.itemsThrough(linesWritten);
  let errorsShown = 0;
  let reportFrom = 0; // items before this one had their error reported by an earlier attempt
  const resume = resumeWith(options, batchId);
  const out = createWriteStream(options.out, { flags: linesWritten > 0 ? 'a' : 'w' });
  // Its errors are read where they matter (write, finished): one nobody listened for would crash the CLI.
  out.on('error', () => {});
  try {
    for (let attempt = 1; ; attempt++) {
      try {
        // `written` counts what is on disk; items still in `buffer` are `pending`, on `pendingLines` lines.
        let buffer = '';
        let pending = 0;
        let pendingLines = 0;
        for await (const line of client.resultLines(batchId, { from: written })) {
          const { value, error, lineBreak } = resultValue(line);
          const multiline = lineBreak === true && !options.ndjson;
          const item = written + pending;
          for (const at = lines.lineOf(item); linesWritten + pendingLines + 1 < at; pendingLines++) buffer += '\n';
          pendingLines++;
          if (error || multiline) {
            // Items a failed batch never processed are counted in its summary, not listed.
            if (item >= reportFrom && error?.code !== NOT_PROCESSED) {
              if (multiline) unwritable++;
              const why = error ? `${error.code} ${error.message}` : 'the plaintext holds a line break, which one line of the output cannot (decrypt with --ndjson to get it)';
              if (errorsShown++ < ERRORS_SHOWN) options.log(`line ${lines.lineOf(item)}: ${why}`);
            }
            reportFrom = Math.max(reportFrom, item + 1);
            buffer += options.ndjson ? 'null\n' : '\n';
          } else {
            buffer += (options.ndjson ? JSON.stringify(value) : value) + '\n';
          }
          // Written every 4,096 lines or 1 MB, whichever comes first: lines of large items add up.
          if (++pending >= 4096 || buffer.length >= 1_048_576) {
            await write(out, buffer, options.out, resume);
            written += pending;
            linesWritten += pendingLines;
            buffer = '';
            pending = 0;
            pendingLines = 0;
          }
        }
        // Blank lines at the input's end, after its last item.
        for (; linesWritten + pendingLines < lines.total; pendingLines++) buffer += '\n';
        await write(out, buffer, options.out, resume);
        written += pending;
        linesWritten += pendingLines;
        break;
      } catch (err) {
        // The output failing (a full disk) is no broken download: reading again cannot help.
        if (err instanceof OutputError) throw err;
        // A break, or a gateway's answer while the API behind it restarts, is retried; an answer of the API is not.
        const status = (err as { status?: number }).status;
        if (attempt >= DOWNLOAD_ATTEMPTS || (status !== undefined && !GATEWAY_ANSWERS.has(status))) throw err;
        options.log(`keyfleet: download interrupted after ${written.toLocaleString('en-US')} results (${(err as Error).message}); resuming`);
        // Whatever was read is on disk: resume from the first result not yet written.
        await sleep(500 * attempt);
      }
    }
  } catch (err) {
    // What was written stays, for --resume. A stream that failed is closed already: waiting for
    // its 'close' would wait for ever.
    out.end();
    await finished(out).catch(() => {});
    throw err;
  }
  out.end();
  // The last lines reach the file only now: a full disk can show here too.
  await finished(out).catch((err: unknown) => {
    throw new OutputError(options.out, resume, err);
  });
  if (errorsShown > ERRORS_SHOWN) options.log(`… and ${errorsShown - ERRORS_SHOWN} more failed items`);
  return { written, unwritable, resumedAfterLine };
}

/** A result line's value, or its error. Ciphertext lines (the common case) skip JSON.parse. */
function resultValue(line: string): { value?: string; error?: { code: string; message: string }; lineBreak?: boolean } {
  const marker = line.indexOf('"ciphertext":"');
  // A ciphertext as it stands in the line: base64, no escapes, so no line break either.
  if (marker !== -1 && line.endsWith('"}')) return { value: line.slice(marker + 14, -2) };
  const parsed = JSON.parse(line) as { ciphertext?: string; plaintext?: string; error?: { code: string; message: string } };
  if (parsed.error) return { error: parsed.error };
  const value = parsed.ciphertext ?? parsed.plaintext ?? '';
  return { value, lineBreak: value.includes('\n') };
}

/**
 * The options that resume the run: the batch, and for NDJSON the flag (the lines written so far
 * are JSON) and the input file (where its blank lines are). The command's --key and --out go with them.
 */
export function resumeWith(options: Pick<BulkOptions, 'ndjson' | 'in'>, batchId: string): string {
  const input = options.ndjson && options.in !== undefined && options.in !== STDIN ? ` --in ${shellWord(options.in)}` : '';
  return `--resume ${batchId}${options.ndjson ? ' --ndjson' : ''}${input}`;
}

/** `word` as one shell word: as it is when that is safe, else in single quotes. */
const shellWord = (word: string): string => (/^[\w@%+=:,./-]+$/.test(word) ? word : `'${word.replaceAll("'", `'\\''`)}'`);

/** `cannot write <what> (<why>)`: why from `reasons` by the error's code, else the code itself. */
export function cannotWrite(what: string, err: unknown, reasons: Readonly<Record<string, string>> = {}): Error {
  const { code, message } = err as NodeJS.ErrnoException;
  return new Error(`cannot write ${what} (${(code && reasons[code]) ?? code ?? message})`, { cause: err });
}

/** Why an output cannot be opened, in words, for the codes a mistyped path gives. */
const OPEN_REASONS = { ENOENT: 'its directory does not exist', EISDIR: 'it is a directory' } as const;

/** The output file cannot be written (ENOSPC, EIO, EFBIG…): the run fails, naming the file and why. */
export class OutputError extends Error {
  constructor(path: string, resume: string, cause: unknown) {
    const { code, message } = cause as NodeJS.ErrnoException;
    super(`cannot write the results to ${path} (${code ?? message}); once it can be written, resume with ${resume}`, { cause });
  }
}

/** Writes `text`, waiting while the stream's buffer is full; a stream that failed fails the write. */
async function write(out: WriteStream, text: string, path: string, resume: string): Promise<void> {
  if (!text) return;
  if (out.errored) throw new OutputError(path, resume, out.errored);
  if (out.write(text)) return;
  // `once` rejects with the stream's error: a failed stream never drains.
  await once(out, 'drain').catch((err: unknown) => {
    throw new OutputError(path, resume, err);
  });
}
