#!/usr/bin/env node
import { fstatSync, type WriteStream } from 'node:fs';
import { open, stat, type FileHandle } from 'node:fs/promises';
import { once } from 'node:events';
import { finished } from 'node:stream/promises';
import { Command, InvalidArgumentError, Option } from 'commander';
import { projectVersion } from '../shared/project-root.js';
import { MAX_TIMER_MS } from '../shared/timers.js';
import { CREATABLE_KEY_TYPES, type KeyType } from '../shared/crypto/key-ring.js';
import type { BatchOp } from '../shared/schemas.js';
import { cannotWrite, rerunWith, resumeWith, runBulk } from './bulk.js';
import { Progress } from './progress.js';
import { KeyfleetClient } from './client.js';
import { KeyfleetApiError } from './errors.js';
import { closeInputs, STDIN } from './lines.js';

/** Exit statuses: 0 all done, 1 a request or the batch failed, 2 some items failed (see stderr). */
const EXIT = { ok: 0, error: 1, itemsFailed: 2, interrupted: 130 } as const;
const DONE = { encrypt: 'encrypted', decrypt: 'decrypted', rewrap: 'rewrapped' } as const;

const log = (line: string): void => void process.stderr.write(line + '\n');
const print = (value: unknown): void => void process.stdout.write(JSON.stringify(value, null, 2) + '\n');

function clientOf(command: Command): KeyfleetClient {
  const { url, token, timeout } = command.optsWithGlobals<{ url?: string; token?: string; timeout?: number }>();
  if (!url) throw new InvalidArgumentError('the API URL is missing: set KEYFLEET_URL or pass --url');
  if (!token) throw new InvalidArgumentError('the token is missing: set KEYFLEET_TOKEN or pass --token');
  return new KeyfleetClient({ url, token, ...(timeout ? { timeoutMs: timeout * 1000 } : {}) });
}

/** A whole-number option's value, `least` or more. */
const wholeNumber = (least: number) => (value: string): number => {
  const n = Number(value);
  if (!Number.isInteger(n) || n < least) throw new InvalidArgumentError(`expected a whole number ≥ ${least}, got ${JSON.stringify(value)}`);
  return n;
};

/** --timeout's value: seconds as the client's time limits take them, more than 0 and at most Node's longest timer (about 24.8 days). */
const timeoutSeconds = (value: string): number => {
  const n = Number(value);
  if (!(n > 0 && n <= MAX_TIMER_MS / 1000)) throw new InvalidArgumentError(`expected a number of seconds > 0 (at most ${Math.floor(MAX_TIMER_MS / 1000)}), got ${JSON.stringify(value)}`);
  return n;
};

/**
 * A preAction hook refusing a run without these options. Commander checks its own required
 * options before unknown ones, so a misspelled `--kye` read as a missing `--key`; checked here,
 * after the unknown-option check, it reads `unknown option '--kye' (Did you mean --key?)`.
 */
const requireOptions = (...names: string[]) => (_program: Command, command: Command): void => {
  const missing = command.options.find((option) => option.long !== undefined && names.includes(option.long) && command.getOptionValue(option.attributeName()) === undefined);
  if (missing) command.error(`error: required option '${missing.flags}' not specified`, { code: 'commander.missingMandatoryOptionValue' });
};

const program = new Command('keyfleet')
  .description('Encrypt, decrypt and re-key files of secrets through a keyfleet service.')
  .version(projectVersion())
  .addOption(new Option('--url <url>', 'the API, e.g. http://127.0.0.1:8080').env('KEYFLEET_URL'))
  .addOption(new Option('--token <token>', 'a bearer token').env('KEYFLEET_TOKEN'))
  .addOption(new Option('--timeout <seconds>', 'seconds to wait for the service to begin an answer (default 30), and for a batch to make progress before saying it waits; a long download or wait ends only after 60 s of silence').env('KEYFLEET_TIMEOUT').argParser(timeoutSeconds))
  .showHelpAfterError('(run with --help for usage)');

for (const op of ['encrypt', 'decrypt', 'rewrap'] as const satisfies readonly BatchOp[]) {
  program
    .command(op)
    .description(`${op} a file, one item per line (or NDJSON with --ndjson), through a batch; results in input order`)
    .option('-k, --key <name>', 'the key')
    .option('-i, --in <file>', 'the input file, - for stdin (required unless --resume)')
    .option('-o, --out <file>', 'where the results go, one per input line (a failed item leaves its line empty, or null with --ndjson)')
    .option('--ndjson', 'input and output lines are JSON strings', false)
    .option('--resume <batchId>', 'pick up an earlier batch: wait for it and download the rest of its results into --out')
    .option('--idempotency-key <key>', 'makes a retried upload return the same batch instead of a second one (without it, the upload gets a key of its own, named when a run must be repeated with it)')
    .option('--callback-url <url>', 'the service POSTs the final status here, signed')
    .option('--context <context>', 'bound into every item (decrypt and rewrap need the same)')
    .addHelpText('after', `\nExit status: 0 all items done, 2 some items failed (listed on stderr with their line numbers), 1 the request or batch failed.\nExample:\n  keyfleet ${op} --key serials ${{ encrypt: '--in serials.txt --out serials.enc', decrypt: '--in serials.enc --out serials.dec', rewrap: '--in old.enc --out new.enc' }[op]}`)
    // Each option only where it means something: rewrap has no plaintexts, encrypt and decrypt no target.
    .addOption(op === 'rewrap' ? new Option('--target-key <name>', 're-encrypt into this key (e.g. from an imported legacy key)') : new Option('--encoding <encoding>', 'plaintexts are utf8 text or base64 bytes').choices(['utf8', 'base64']))
    .hook('preAction', requireOptions('--key', '--out'))
    .action(async (opts: { key: string; in?: string; out: string; ndjson: boolean; encoding?: 'utf8' | 'base64'; resume?: string; idempotencyKey?: string; callbackUrl?: string; context?: string; targetKey?: string }, command: Command) => {
      // `-` is stdin for --in; for --out it would be a file of that name, which a resumed run appends to.
      if (opts.out === STDIN) throw new Error('--out - is not taken: the results go to a file, which --resume can append to (`keyfleet batch results <id>` writes them to stdout)');
      await refuseSameFile(opts.in, opts.out);
      const client = clientOf(command);
      // Ctrl-C during the upload leaves nothing to resume: the service fails a cut-short upload.
      // One sent whole may have been made into a batch, answer or not: its key gets that one.
      let batchId = opts.resume;
      let sentWith: string | undefined;
      process.once('SIGINT', () => {
        Progress.stopAll();
        if (batchId) log(`\nkeyfleet: interrupted; the batch goes on in the service (resume with ${resumeWith(opts, batchId)})`);
        else if (sentWith) log(`\nkeyfleet: interrupted before the service answered the upload; it may have made the batch: ${rerunWith(sentWith)}`);
        else log('\nkeyfleet: interrupted before the service accepted the upload; the service fails the batch of such an upload (KF_UPLOAD_ABORTED) and gives out none of its results');
        process.exit(EXIT.interrupted);
      });
      const started = Date.now();
      // A batch that makes no progress for as long as an answer may take is said to wait (for a worker, say).
      const { timeout } = command.optsWithGlobals<{ timeout?: number }>();
      const outcome = await runBulk(client, { op, ...opts, log, onAccepted: (id) => (batchId = id), onSentWhole: (key) => (sentWith = key), ...(timeout ? { stallNoticeMs: timeout * 1000 } : {}) });
      const elapsedSeconds = (Date.now() - started) / 1000;
      const listed = outcome.failed - outcome.notProcessed;
      // A resumed run saw only the results after the lines already written: the failures among those were listed by the run that wrote them.
      const before = outcome.resumedAfterLine;
      const where = before ? ` (those after line ${before.toLocaleString('en-US')} above; the earlier run that wrote lines 1 to ${before.toLocaleString('en-US')} listed its own)` : ' (see above)';
      log(`keyfleet: ${outcome.succeeded.toLocaleString('en-US')} of ${outcome.total.toLocaleString('en-US')} ${outcome.total === 1 ? 'item' : 'items'} ${DONE[op]} into ${opts.out} in ${elapsedSeconds.toFixed(1)} s` + (listed ? `; ${listed.toLocaleString('en-US')} failed${where}` : ''));
      if (outcome.status === 'failed') {
        const why = outcome.error ? ` (${outcome.error.code}: ${outcome.error.message})` : '';
        log(`keyfleet: batch ${outcome.batchId} failed${why}; the ${outcome.notProcessed.toLocaleString('en-US')} ${outcome.notProcessed === 1 ? 'item' : 'items'} it did not process ${outcome.notProcessed === 1 ? 'has an empty line' : 'have empty lines'}${opts.ndjson ? ' (null)' : ''}`);
      }
      process.exitCode = outcome.status === 'failed' ? EXIT.error : outcome.failed > 0 ? EXIT.itemsFailed : EXIT.ok;
    });
}

const keys = program.command('keys').description('create, list, show and rotate keys (material never leaves the service)');
keys
  .command('create <name>')
  .description('create a key (or find it, if it exists with the same type)')
  .addOption(new Option('--type <type>', 'the key type').choices([...CREATABLE_KEY_TYPES]))
  .option('--convergent', 'the same plaintext and context give the same ciphertext (every call then needs --context)', false)
  .action(async (name: string, opts: { type?: KeyType; convergent: boolean }, command: Command) => {
    const { created, ...info } = await clientOf(command).createKey(name, opts.type, { convergent: opts.convergent });
    log(created ? `keyfleet: key ${name} created` : `keyfleet: key ${name} exists`);
    print(info);
  });
keys
  .command('list')
  .description('list the tenant’s keys in name order, one JSON line of metadata each')
  .action(async (_opts: unknown, command: Command) => {
    for await (const info of clientOf(command).allKeys()) {
      if (!process.stdout.write(JSON.stringify(info) + '\n')) await once(process.stdout, 'drain');
    }
  });
keys.command('show <name>').description('show a key’s metadata').action(async (name: string, _opts: unknown, command: Command) => print(await clientOf(command).getKey(name)));
keys.command('rotate <name>').description('add a version; new ciphertexts use it').action(async (name: string, _opts: unknown, command: Command) => print(await clientOf(command).rotateKey(name)));

const batch = program.command('batch').description('list batches; status, cancellation and results of a batch');
batch
  .command('list')
  .description('list the tenant’s batches, newest first, one JSON line of status each')
  .option('--limit <n>', 'at most n batches', wholeNumber(1))
  .action(async (opts: { limit?: number }, command: Command) => {
    let left = opts.limit ?? Infinity;
    for await (const status of clientOf(command).allBatches({ pageSize: Math.min(left, 1000) })) {
      if (!process.stdout.write(JSON.stringify(status) + '\n')) await once(process.stdout, 'drain');
      if (--left === 0) break;
    }
  });
batch.command('status <id>').description('show a batch’s status and counts').action(async (id: string, _opts: unknown, command: Command) => print(await clientOf(command).batch(id)));
batch.command('cancel <id>').description('cancel what has not run and delete the results').action(async (id: string, _opts: unknown, command: Command) => print(await clientOf(command).cancelBatch(id)));
batch
  .command('results <id>')
  .description('write a batch’s result lines (NDJSON, input order) to stdout or --out')
  .option('-o, --out <file>', 'write to a file instead of stdout')
  .option('--from <n>', 'start at item n', wholeNumber(0), 0)
  .action(async (id: string, opts: { out?: string; from: number }, command: Command) => {
    const client = clientOf(command);
    const file = opts.out;
    // Opened before anything is fetched, so a path that cannot be written fails at once, plainly;
    // but emptied only once the service answers with results: a mistyped or deleted batch, or
    // one that failed during its upload, leaves a file that was there as it was.
    const opened = file ? await openOutput(file) : undefined;
    const out = opened?.stream ?? process.stdout;
    // Only a regular file has anything to empty (a FIFO, /dev/null, a terminal cannot be
    // truncated); through the open handle, so a path swapped since the open is left alone.
    let emptied = !opened || !(await opened.handle.stat()).isFile();
    const empty = async (): Promise<void> => {
      if (emptied) return;
      await opened!.handle.truncate(0).catch((err: unknown) => Promise.reject(failed(err)));
      emptied = true;
    };
    const failed = (err: unknown): Error => (file ? cannotWrite(file, err) : (err as Error));
    for await (const line of client.resultLines(id, { from: opts.from })) {
      await empty();
      if (out.errored) throw failed(out.errored);
      // `once` rejects with the stream's error: a failed stream never drains.
      if (!out.write(line + '\n')) await once(out, 'drain').catch((err: unknown) => Promise.reject(failed(err)));
    }
    if (file) {
      await empty();
      out.end();
      await finished(out).catch((err: unknown) => Promise.reject(failed(err)));
    }
  });

/**
 * Refuses an --out that is the --in file, however either is spelt (a relative or absolute path, a
 * symlink, a hard link: the same device and inode): the results would be written over the input,
 * and a batch whose items failed would leave nothing of it. Only a regular file can be lost so; a
 * terminal or pipe named twice is left alone. Checked before anything is uploaded or --out opened.
 */
async function refuseSameFile(input: string | undefined, output: string): Promise<void> {
  if (input === undefined) return;
  // bigint: inode numbers can pass 2^53, where two numbers could round to one.
  // `--in -` with stdin redirected from the --out file (`< serials.txt`) is the same loss.
  const [from, to] = await Promise.all([input, output].map((path) => (path === STDIN ? Promise.resolve().then(() => fstatSync(0, { bigint: true })) : stat(path, { bigint: true })).catch(() => undefined)));
  // Either missing or unreadable: not the same file, or the run fails on it as before.
  if (from?.isFile() && to?.isFile() && from.dev === to.dev && from.ino === to.ino) {
    throw new Error('--out is the same file as --in; write the results elsewhere');
  }
}

/**
 * A file opened for writing, appended to (emptying it is the caller's to do), with its handle;
 * the stream's errors are read where they matter (an unheard 'error' would crash the CLI with a
 * stack).
 */
async function openOutput(path: string): Promise<{ stream: WriteStream; handle: FileHandle }> {
  const handle = await open(path, 'a').catch((err: unknown) => Promise.reject(cannotWrite(path, err)));
  const stream = handle.createWriteStream();
  stream.on('error', () => {});
  return { stream, handle };
}

// An empty or blank variable counts as unset, as the service reads its own (`VAR=` in an env
// file, compose's `${VAR:-}`): commander would read KEYFLEET_TIMEOUT= as a value, and refuse it.
for (const name of ['KEYFLEET_URL', 'KEYFLEET_TOKEN', 'KEYFLEET_TIMEOUT']) if (process.env[name]?.trim() === '') delete process.env[name];

// A reader that stops early (`keyfleet batch results <id> | head`) has what it wanted: end
// quietly, as other tools do, rather than report the broken pipe as a failure.
process.stdout.on('error', (err: NodeJS.ErrnoException) => {
  if (err.code !== 'EPIPE') throw err;
  process.exit(EXIT.ok);
});

try {
  await program.parseAsync(process.argv);
} catch (err) {
  // The client's own refusals name themselves for library users: here the line's prefix does.
  log(`keyfleet: ${String(err instanceof Error ? err.message : err).replace(/^keyfleet client: /, '')}`);
  // The API names its query parameter; here it is an option.
  if (err instanceof KeyfleetApiError && err.code === 'KF_CONTEXT_REQUIRED') log('keyfleet: pass the items’ context with --context <context> (the same to encrypt, decrypt and rewrap them)');
  process.exitCode = EXIT.error;
} finally {
  // An input still being read: the run ended before it (refused), with nothing left to write
  // but stderr, which is synchronous here. Exiting ends a read a named pipe's writer holds open.
  if (closeInputs() > 0) process.exit();
}
