import { execFileSync, type ChildProcess } from 'node:child_process';
import { closeSync, createWriteStream, existsSync, linkSync, openSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync, writeFileSync, truncateSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import { createServer as createTcpServer, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KeyfleetApiError, KeyfleetClient, KeyfleetConnectionError, retryDelayMs } from '../../client/index.js';
import { nativeKernel } from '../../shared/crypto/native-kernel.js';
import { STAND_IN_TOKEN, testEnv } from '../helpers/env.js';
import { runCli } from '../helpers/cli.js';
import { freePort, tcpProxy } from '../helpers/net.js';
import { type ApiProcess, startApi, startApiAndWorker, startWorker, type RunningProcess } from '../helpers/processes.js';

// No key cache: a rotation done through the API shows in the worker's next chunk (by default within KEY_CACHE_TTL_MS).
// The worker at its production scheduling (tests default to normal priority), checked below.
const { env, admin } = testEnv({ CHUNK_ITEMS: '5000', KEY_CACHE_TTL_MS: '0', WORKER_SCHED: 'idle', WORKER_NICE: '19' });
let api: ApiProcess;
let worker: RunningProcess;
let url: string;
let dir: string;

beforeAll(async () => {
  [api, worker] = await startApiAndWorker(env);
  url = api.url;
  dir = mkdtempSync(join(tmpdir(), 'keyfleet-cli-'));
});
afterAll(async () => {
  await Promise.all([worker?.stop(), api?.stop()]);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

/** The built CLI as the admin tenant against this file's API; `started` gets the process, to signal it. */
const keyfleet = (args: string[], extraEnv: Record<string, string> = {}, started?: (child: ChildProcess) => void, stdin?: string | Buffer | { fd: number }) =>
  runCli(args, { cwd: dir, env: { KEYFLEET_URL: url, KEYFLEET_TOKEN: admin.token, ...extraEnv }, ...(started ? { started } : {}), ...(stdin !== undefined ? { stdin } : {}) });

const path = (name: string) => join(dir, name);

/** `watch` a CLI run (runCli's `started`); `said` resolves once its stderr holds `text`. */
function stderrSays(text: string): { watch: (child: ChildProcess) => void; said: Promise<void> } {
  let resolve: () => void = () => {};
  const said = new Promise<void>((done) => (resolve = done));
  const watch = (child: ChildProcess): void => {
    let seen = '';
    child.stderr!.on('data', (d) => (seen += d) && seen.includes(text) && resolve());
  };
  return { watch, said };
}

describe('the keyfleet CLI', () => {
  it('answers --help for itself and every command, and says what is missing', async () => {
    for (const args of [['--help'], ['encrypt', '--help'], ['keys', '--help'], ['batch', 'results', '--help']]) {
      const { code, stdout } = await keyfleet(args);
      expect(code).toBe(0);
      expect(stdout).toMatch(/^Usage: keyfleet/);
    }
    const missing = await keyfleet(['keys', 'show', 'serials'], { KEYFLEET_URL: '' });
    expect(missing.code).toBe(1);
    expect(missing.stderr).toContain('KEYFLEET_URL');
    // A listing of no batches is a mistake, not an empty answer: the API refuses limit=0 too.
    const none = await keyfleet(['batch', 'list', '--limit', '0']);
    expect([none.code, none.stdout]).toEqual([1, '']);
    expect(none.stderr).toContain('expected a whole number ≥ 1, got "0"');
    // A misspelled option is named as such, not as the required option it was meant to be.
    const misspelled = await keyfleet(['encrypt', '--kye', 'serials', '--in', 'x.txt', '--out', 'x.enc']);
    expect([misspelled.code, misspelled.stdout]).toEqual([1, '']);
    expect(misspelled.stderr).toMatch(/^error: unknown option '--kye'\n\(Did you mean --key\?\)/);
    for (const [args, flags] of [[['--in', 'x.txt', '--out', 'x.enc'], '-k, --key <name>'], [['--key', 'serials', '--in', 'x.txt'], '-o, --out <file>']] as const) {
      const left = await keyfleet(['encrypt', ...args]);
      expect([left.code, left.stdout]).toEqual([1, '']);
      expect(left.stderr).toMatch(new RegExp(`^error: required option '${flags}' not specified\n`));
    }
    expect(existsSync(path('x.enc'))).toBe(false);
    // The client's own refusals, once prefixed.
    const credentials = await keyfleet(['keys', 'show', 'serials'], { KEYFLEET_URL: url.replace('http://', 'http://user:pw@') });
    expect(credentials.code).toBe(1);
    expect(credentials.stderr).toMatch(/^keyfleet: the URL holds credentials/);
    expect(credentials.stderr).not.toContain('pw');
  });

  it('names its --context option when a convergent key needs a context', async () => {
    expect((await keyfleet(['keys', 'create', 'convergent-cli', '--convergent'])).code).toBe(0);
    writeFileSync(path('conv.txt'), 'a\n');
    const refused = await keyfleet(['encrypt', '--key', 'convergent-cli', '--in', 'conv.txt', '--out', 'conv.enc']);
    expect(refused.code).toBe(1);
    expect(refused.stderr).toContain('KF_CONTEXT_REQUIRED');
    expect(refused.stderr).toContain('keyfleet: pass the items’ context with --context <context>');
    const sealed = await keyfleet(['encrypt', '--key', 'convergent-cli', '--context', 'tenant-a', '--in', 'conv.txt', '--out', 'conv.enc']);
    expect(sealed.code, sealed.stderr).toBe(0);
    expect(sealed.stderr).toContain('1 of 1 item encrypted');
  });

  it('gives a --help example for decrypt that reads what the encrypt example wrote, into another file', async () => {
    const example = async (op: string) => /\nExample:\n {2}(.+)/.exec((await keyfleet([op, '--help'])).stdout)![1]!;
    const file = (line: string, option: '--in' | '--out') => new RegExp(`${option} (\\S+)`).exec(line)![1]!;
    const encrypt = await example('encrypt');
    const decrypt = await example('decrypt');
    expect(decrypt).toBe('keyfleet decrypt --key serials --in serials.enc --out serials.dec');
    expect(file(decrypt, '--in')).toBe(file(encrypt, '--out'));
    // Neither over the file it reads, nor over the plaintexts the encrypt example started from.
    expect(file(decrypt, '--out')).not.toBe(file(decrypt, '--in'));
    expect(file(decrypt, '--out')).not.toBe(file(encrypt, '--in'));
  });

  it('on Ctrl-C names the batch to resume, or the key that gets a batch the service may have made, or says that nothing of the upload is given out, and exits 130', async () => {
    // A stand-in API that never gets done, so Ctrl-C surely comes during the upload, or while the batch runs.
    let acceptUploads = false;
    let awaited: { request: RegExp; seen: () => void } | undefined;
    const keys: string[] = [];
    const server: Server = createServer((req, res) => {
      if (req.method === 'POST' && acceptUploads) {
        req.resume().on('end', () => res.writeHead(202, { 'content-type': 'application/json' }).end(JSON.stringify({ batchId: 'Ab12Cd34Ef56Gh78', status: 'queued', total: 2 })));
      } else if (req.url?.endsWith('/events')) {
        res.writeHead(200, { 'content-type': 'text/event-stream' }).flushHeaders();
      } else if (req.method === 'GET' && /^\/v1\/batches\/[\w-]+$/.test(req.url ?? '')) {
        // A status: the batch to resume runs, as its command asks.
        const id = req.url!.split('/').pop();
        const status = { id, op: id === 'Zy98Xw76Vu54Ts32' ? 'decrypt' : 'encrypt', key: 'serials', status: 'running', total: 2, processed: 0, succeeded: 0, failed: 0, createdAt: new Date().toISOString() };
        res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(status));
      } else if (!req.url?.includes('key=unread')) {
        // An upload read to its end, never answered: seen as `… whole`.
        keys.push(String(req.headers['idempotency-key']));
        req.resume().on('end', () => awaited?.request.test(`${req.method} ${req.url} whole`) && awaited.seen());
      } // else an upload never read
      if (awaited?.request.test(`${req.method} ${req.url}`)) awaited.seen();
    });
    await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
    const standIn = `http://127.0.0.1:${(server.address() as { port: number }).port}`;
    const interruptAfter = async (request: RegExp, args: string[]) => {
      let cli: ChildProcess | undefined;
      const seen = new Promise<void>((ok) => (awaited = { request, seen: ok }));
      const run = keyfleet(args, { KEYFLEET_URL: standIn }, (child) => (cli = child));
      // A CLI that ended on its own is not signalled; its output then says why.
      await Promise.race([seen, run]);
      cli!.kill('SIGINT');
      return run;
    };
    try {
      // An upload cut short (32 MB, not read: more than the connection holds) makes no batch.
      writeFileSync(path('big.txt'), `${'x'.repeat(39)}\n`.repeat(800_000));
      const uploading = await interruptAfter(/^POST \/v1\/batches\?/, ['encrypt', '--key', 'unread', '--in', 'big.txt', '--out', 'big.enc']);
      expect(uploading.code).toBe(130);
      expect(uploading.stderr).toContain('keyfleet: interrupted before the service accepted the upload; the service fails the batch of such an upload (KF_UPLOAD_ABORTED) and gives out none of its results\n');
      expect(uploading.stderr).not.toContain('--resume');
      expect(existsSync(path('big.enc'))).toBe(false); // made for the run, nothing written: gone again

      // An upload sent whole may have been made into a batch, answer or not: its key gets that one.
      writeFileSync(path('two.txt'), 'a\nb\n');
      const encrypt = ['encrypt', '--key', 'serials', '--in', 'two.txt', '--out', 'two.enc'];
      const unanswered = await interruptAfter(/^POST \/v1\/batches\?.* whole$/, encrypt);
      expect(unanswered.code).toBe(130);
      expect(keys).toHaveLength(1);
      expect(unanswered.stderr).toContain(`keyfleet: interrupted before the service answered the upload; it may have made the batch: run the same command again with --idempotency-key ${keys[0]} to get it rather than a second one\n`);
      expect(unanswered.stderr).not.toContain('KF_UPLOAD_ABORTED');

      acceptUploads = true;
      const running = await interruptAfter(/^GET \/v1\/batches\/Ab12Cd34Ef56Gh78\/events$/, encrypt);
      expect(running.code).toBe(130);
      expect(running.stderr).toContain('keyfleet: interrupted; the batch goes on in the service (resume with --resume Ab12Cd34Ef56Gh78)\n');

      const resumed = await interruptAfter(/^GET \/v1\/batches\/Zy98Xw76Vu54Ts32\/events$/, ['decrypt', '--key', 'serials', '--resume', 'Zy98Xw76Vu54Ts32', '--out', 'two.dec']);
      expect(resumed.code).toBe(130);
      expect(resumed.stderr).toContain('keyfleet: interrupted; the batch goes on in the service (resume with --resume Zy98Xw76Vu54Ts32)\n');
    } finally {
      server.closeAllConnections();
      await new Promise((ok) => server.close(ok));
    }
  });

  it('says which URL it cannot reach and why, without the token', async () => {
    const closed = `http://127.0.0.1:${await freePort()}`;
    writeFileSync(path('unsent.txt'), 'a\nb\n');
    for (const args of [['keys', 'show', 'serials'], ['encrypt', '--key', 'serials', '--in', 'unsent.txt', '--out', 'unsent.enc']]) {
      const { code, stderr } = await keyfleet(args, { KEYFLEET_URL: closed });
      expect(code).toBe(1);
      expect(stderr).toContain(`keyfleet: cannot reach ${closed} (ECONNREFUSED)\n`);
      expect(stderr).not.toContain(admin.token);
    }
    const unknown = await keyfleet(['keys', 'show', 'serials', '--token', admin.token], { KEYFLEET_URL: 'http://keyfleet.invalid' });
    expect(unknown.code).toBe(1);
    // No such name, or (EAI_AGAIN) no resolver answering in a sandbox.
    expect(unknown.stderr).toMatch(/^keyfleet: cannot reach http:\/\/keyfleet\.invalid \((ENOTFOUND|EAI_AGAIN)\)\n$/);
  });

  it('encrypts a 50,000-line file with progress into 50,000 ciphertexts in order, and decrypt gives the file back byte for byte', async () => {
    expect((await keyfleet(['keys', 'create', 'serials'])).code).toBe(0);
    const original = Array.from({ length: 50_000 }, (_, i) => `SN-${String(i + 1).padStart(7, '0')}-${((i * 2654435761) >>> 0).toString(36)}${i % 97 === 0 ? ' ünïcode ✓' : ''}`).join('\n') + '\n';
    writeFileSync(path('serials.txt'), original);

    const sealed = await keyfleet(['encrypt', '--key', 'serials', '--in', 'serials.txt', '--out', 'serials.enc']);
    expect(sealed.code).toBe(0);
    // Not a terminal: plain progress lines, then the summary.
    // The file (about 931 KB) in KB, not as 0.9 MB.
    expect(sealed.stderr).toContain(`/${(Buffer.byteLength(original) / 1e3).toFixed(1)} KB (100%)`);
    expect(sealed.stderr).toMatch(/keyfleet: upload [\d.]+\/[\d.]+ KB \(\d+%\), [\d.]+ [KM]B\/s/);
    expect(sealed.stderr).toMatch(/keyfleet: encrypt 50,000\/50,000 items \(100%\), [\d,]+ items\/s/);
    expect(sealed.stderr).toContain('50,000 of 50,000 items encrypted into serials.enc');
    const lines = readFileSync(path('serials.enc'), 'utf8').split('\n');
    expect(lines.pop()).toBe('');
    expect(lines).toHaveLength(50_000);
    for (const line of lines) expect(line).toMatch(/^kf:v1:[A-Za-z0-9+/]+=*$/);

    const opened = await keyfleet(['decrypt', '--key', 'serials', '--in', 'serials.enc', '--out', 'serials.dec']);
    expect(opened.code).toBe(0);
    expect(readFileSync(path('serials.dec')).equals(Buffer.from(original))).toBe(true);
  });

  it('with the same --idempotency-key again, follows the batch made before and says so, writing the same results', async () => {
    writeFileSync(path('again.txt'), 'AGAIN-1\nAGAIN-2\nAGAIN-3\n');
    const args = ['encrypt', '--key', 'serials', '--in', 'again.txt', '--out', 'again.enc', '--idempotency-key', 'import-again-1'];
    const first = await keyfleet(args);
    expect(first.code, first.stderr).toBe(0);
    const batchId = /keyfleet: batch ([\w-]+) accepted, 3 items/.exec(first.stderr)?.[1];
    expect(batchId).toBeDefined();
    const sealed = readFileSync(path('again.enc'), 'utf8');
    const second = await keyfleet(args);
    expect(second.code, second.stderr).toBe(0);
    expect(second.stderr).toContain(`keyfleet: batch ${batchId} accepted, made earlier under --idempotency-key import-again-1, 3 items`);
    // The earlier batch's results, not fresh ciphertexts of a second batch.
    expect(readFileSync(path('again.enc'), 'utf8')).toBe(sealed);
  });

  it('reports failed items with their line numbers and exits 2, keeping every other line in place', async () => {
    const good = readFileSync(path('serials.enc'), 'utf8').split('\n').slice(0, 3);
    writeFileSync(path('mixed.enc'), [good[0], 'kf:v1:AAAA', good[1], 'not a ciphertext', good[2]].join('\n') + '\n');
    const { code, stderr } = await keyfleet(['decrypt', '--key', 'serials', '--in', 'mixed.enc', '--out', 'mixed.dec']);
    expect(code).toBe(2);
    expect(stderr).toContain('line 2: KF_DECRYPT_FAILED');
    expect(stderr).toContain('line 4: KF_DECRYPT_FAILED');
    expect(stderr).toContain('3 of 5 items decrypted');
    const out = readFileSync(path('mixed.dec'), 'utf8').split('\n');
    expect(out.slice(0, 5)).toEqual(['SN-0000001-0 ünïcode ✓', '', 'SN-0000002-17wdrqp', '', 'SN-0000003-grnhia']);
  });

  it('writes what a batch that failed after its upload made, leaves the lines it never processed empty, says why and exits 1', async () => {
    // One thread, one chunk at a time, in order: chunks of 4, 4 and 3 under a nonce budget of 10,
    // so the third is refused and the batch fails once its first two have run.
    const own = testEnv({ NONCE_LIMIT: '10', NONCE_ROTATE_SHARE: '0', CHUNK_ITEMS: '4', WORKER_THREADS: '1', WORKER_CONCURRENCY: '1' });
    const budgetApi = await startApi(own.env);
    let budgetWorker: RunningProcess | undefined;
    try {
      const run = (args: string[], started?: (child: ChildProcess) => void) => runCli(args, { cwd: dir, env: { KEYFLEET_URL: budgetApi.url, KEYFLEET_TOKEN: own.admin.token }, ...(started ? { started } : {}) });
      expect((await run(['keys', 'create', 'budget'])).code).toBe(0);
      const serials = Array.from({ length: 11 }, (_, i) => `BUDGET-${i + 1}`);
      writeFileSync(path('budget.txt'), serials.join('\n') + '\n');
      // The worker starts once the upload is accepted (whole): a chunk refused while the upload
      // still arrived would fail the upload instead.
      const accepted = stderrSays(' accepted, ');
      const encrypting = run(['encrypt', '--key', 'budget', '--in', 'budget.txt', '--out', 'budget.enc'], accepted.watch);
      await Promise.race([accepted.said, encrypting]);
      budgetWorker = await startWorker(own.env);
      const { code, stderr } = await encrypting;
      expect(code, stderr).toBe(1);
      const out = readFileSync(path('budget.enc'), 'utf8').split('\n');
      expect(out).toHaveLength(12);
      expect(out.slice(0, 8).every((line) => line.startsWith('kf:v1:'))).toBe(true);
      expect(out.slice(8)).toEqual(['', '', '', '']);
      expect(stderr).toContain('8 of 11 items encrypted into budget.enc');
      expect(stderr).toMatch(/keyfleet: batch [\w-]+ failed \(KF_CHUNK_FAILED: .*KF_NONCE_BUDGET_EXHAUSTED.*\); the 3 items it did not process have empty lines\n/);
      // Counted, not listed one by one, and not counted again as failed items.
      expect(stderr).not.toMatch(/^line \d+:/m);
      expect(stderr).not.toContain('failed (see above)');
      // What it made decrypts.
      writeFileSync(path('budget-made.enc'), out.slice(0, 8).join('\n') + '\n');
      expect((await run(['decrypt', '--key', 'budget', '--in', 'budget-made.enc', '--out', 'budget-made.dec'])).code).toBe(0);
      expect(readFileSync(path('budget-made.dec'), 'utf8')).toBe(serials.slice(0, 8).join('\n') + '\n');
    } finally {
      await Promise.all([budgetWorker?.stop(), budgetApi.stop()]);
    }
  });

  it('says once that a batch makes no progress (no worker running), goes on waiting, and finishes when a worker comes', async () => {
    const own = testEnv({ CHUNK_ITEMS: '500' });
    const idleApi = await startApi(own.env);
    let lateWorker: RunningProcess | undefined;
    try {
      // --timeout (here KEYFLEET_TIMEOUT) is also how long a batch may make no progress before the CLI says so.
      const run = (args: string[], started?: (child: ChildProcess) => void) => runCli(args, { cwd: dir, env: { KEYFLEET_URL: idleApi.url, KEYFLEET_TOKEN: own.admin.token, KEYFLEET_TIMEOUT: '2' }, ...(started ? { started } : {}) });
      expect((await run(['keys', 'create', 'waiting'])).code).toBe(0);
      writeFileSync(path('waiting.txt'), Array.from({ length: 2_000 }, (_, i) => `WAIT-${i}`).join('\n') + '\n');
      const stalled = stderrSays('(is one running?)');
      const encrypting = run(['encrypt', '--key', 'waiting', '--in', 'waiting.txt', '--out', 'waiting.enc'], stalled.watch);
      await Promise.race([stalled.said, encrypting]);
      // Still waiting, not failed, while no worker runs: the batch is only queued.
      expect(await Promise.race([encrypting.then(() => 'ended'), new Promise((r) => setTimeout(() => r('waiting'), 2_500))])).toBe('waiting');
      lateWorker = await startWorker(own.env);
      const { code, stderr } = await encrypting;
      expect(code, stderr).toBe(0);
      const batchId = /batch ([\w-]+) accepted/.exec(stderr)![1]!;
      const notices = stderr.split('\n').filter((line) => line.includes('(is one running?)'));
      // Once per stall, however long it lasts: 2 s of silence, then 2.5 s more.
      expect(notices).toEqual([`keyfleet: batch ${batchId} is queued, 0 of 2,000 items processed, none in the last 2 s: its chunks wait for a worker (is one running?). Still waiting; Ctrl-C leaves the batch to resume with --resume ${batchId}`]);
      expect(stderr).toContain('2,000 of 2,000 items encrypted into waiting.enc');
      expect(readFileSync(path('waiting.enc'), 'utf8').split('\n').filter((line) => line.startsWith('kf:v1:'))).toHaveLength(2_000);
    } finally {
      await Promise.all([lateWorker?.stop(), idleApi.stop()]);
    }
  });

  it('resumes a download cut mid-way and reports each failed item once', async () => {
    // 20,000 ciphertexts, every 1,000th replaced by one that fails.
    const lines = readFileSync(path('serials.enc'), 'utf8').split('\n').slice(0, 20_000);
    const failing = lines.map((_, i) => i + 1).filter((line) => line % 1_000 === 0);
    for (const line of failing) lines[line - 1] = 'kf:v1:AAAA';
    writeFileSync(path('cut.enc'), lines.join('\n') + '\n');
    // A proxy to the API that cuts the first results download after 300 KB of its answer
    // (about 7,000 of the 20,000 lines: past the CLI's first write of 4,096), then answers the
    // second 502, as a gateway does while the API behind it restarts.
    let cuts = 0;
    let gatewayAnswers = 0;
    const cutting = new WeakMap<Socket, { answered: number }>();
    const proxy = await tcpProxy('127.0.0.1', Number(new URL(url).port), {
      fromClient(data, { client, upstream }) {
        const results = /^GET \/v1\/batches\/[^/]+\/results/.test(data.toString('latin1'));
        if (results && cuts === 1 && gatewayAnswers === 0) {
          gatewayAnswers++;
          client.end('HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n');
          return;
        }
        if (results && cuts === 0) cutting.set(client, { answered: 0 });
        upstream.write(data);
      },
      fromUpstream(data, connection) {
        connection.client.write(data);
        const cut = cutting.get(connection.client);
        if (cut && (cut.answered += data.length) > 300_000) {
          cuts++;
          cutting.delete(connection.client);
          connection.cut();
        }
      },
    });
    try {
      const { code, stderr } = await keyfleet(['decrypt', '--key', 'serials', '--in', 'cut.enc', '--out', 'cut.dec'], { KEYFLEET_URL: `http://127.0.0.1:${proxy.port}` });
      expect(code, stderr).toBe(2);
      expect(cuts).toBe(1);
      expect(gatewayAnswers).toBe(1);
      expect(stderr).toMatch(/keyfleet: download interrupted after [\d,]+ results \(.*\); resuming/);
      expect(stderr).toMatch(/keyfleet: download interrupted after [\d,]+ results \(KF_UNEXPECTED_ANSWER \(HTTP 502\): Bad Gateway\); resuming/);
      const reported = [...stderr.matchAll(/^line (\d+): KF_DECRYPT_FAILED/gm)].map((m) => Number(m[1]));
      expect(reported).toEqual(failing);
      expect(stderr).toContain('19,980 of 20,000 items decrypted');
      const out = readFileSync(path('cut.dec'), 'utf8').split('\n');
      expect(out).toHaveLength(20_001);
      expect(out.filter((line) => line === '')).toHaveLength(21); // the failed lines, and after the last newline
      expect(out[0]).toBe('SN-0000001-0 ünïcode ✓');
      expect(out[19_998]).toBe(readFileSync(path('serials.dec'), 'utf8').split('\n')[19_998]);
    } finally {
      await proxy.close();
    }
  });

  it('refuses an --out it cannot write before it uploads anything', async () => {
    const { code, stderr } = await keyfleet(['encrypt', '--key', 'serials', '--in', 'unsent.txt', '--out', 'no-such-dir/unsent.enc']);
    expect(code).toBe(1);
    expect(stderr).toBe('keyfleet: cannot write --out no-such-dir/unsent.enc (its directory does not exist)\n');
    mkdirSync(path('a-dir'));
    const directory = await keyfleet(['encrypt', '--key', 'serials', '--in', 'unsent.txt', '--out', 'a-dir']);
    expect(directory.code).toBe(1);
    expect(directory.stderr).toBe('keyfleet: cannot write --out a-dir (it is a directory)\n');
  });

  it('refuses an --out that is the --in file, under any name, and leaves it as it was', async () => {
    // Written over, the input was lost: with a wrong key, every line of the ciphertexts came back empty.
    const ciphertexts = readFileSync(path('serials.enc'), 'utf8').split('\n').slice(0, 3).join('\n') + '\n';
    writeFileSync(path('same.enc'), ciphertexts);
    symlinkSync('same.enc', path('same-symlink.enc'));
    linkSync(path('same.enc'), path('same-hardlink.enc'));
    writeFileSync(path('same.txt'), 'a\nb\n');
    const runs = [
      ['decrypt', '--key', 'serials', '--in', 'same.enc', '--out', 'same.enc'],
      ['decrypt', '--key', 'serials', '--in', 'same.enc', '--out', path('same.enc')],
      ['decrypt', '--key', 'serials', '--in', 'same.enc', '--out', './same.enc'],
      ['decrypt', '--key', 'serials', '--in', 'same.enc', '--out', 'same-symlink.enc'],
      ['rewrap', '--key', 'serials', '--in', 'same-hardlink.enc', '--out', 'same.enc'],
      ['decrypt', '--key', 'serials', '--ndjson', '--resume', 'Ab12Cd34Ef56Gh78', '--in', 'same.enc', '--out', 'same-hardlink.enc'],
      ['encrypt', '--key', 'serials', '--in', 'same.txt', '--out', 'same.txt'],
    ];
    for (const args of runs) {
      const { code, stderr } = await keyfleet(args);
      expect({ code, stderr }, args.join(' ')).toEqual({ code: 1, stderr: 'keyfleet: --out is the same file as --in; write the results elsewhere\n' });
    }
    expect(readFileSync(path('same.enc'), 'utf8')).toBe(ciphertexts);
    expect(readFileSync(path('same.txt'), 'utf8')).toBe('a\nb\n');
  });

  it('reads --in - from stdin, piped or redirected from a file, and refuses stdin redirected from the --out file', async () => {
    const piped = await keyfleet(['encrypt', '--key', 'serials', '--in', '-', '--out', 'piped.enc'], {}, undefined, 'from\na pipe\n');
    expect(piped.code, piped.stderr).toBe(0);
    expect(piped.stderr).toContain('2 of 2 items encrypted into piped.enc');
    // A pipe's size is unknown: the upload's progress has no total to count towards.
    // 12 bytes read as such, not as 0.0 MB.
    expect(piped.stderr).toMatch(/^keyfleet: upload 12 B, [\d.]+ [KM]?B\/s$/m);
    expect(piped.stderr).not.toMatch(/keyfleet: upload [\d.]+\/[\d.]+/);
    writeFileSync(path('piped.txt'), 'from\na pipe\n');
    const fd = openSync(path('piped.enc'), 'r');
    try {
      const opened = await keyfleet(['decrypt', '--key', 'serials', '--in', '-', '--out', 'piped.dec'], {}, undefined, { fd });
      expect(opened.code, opened.stderr).toBe(0);
    } finally {
      closeSync(fd);
    }
    expect(readFileSync(path('piped.dec'), 'utf8')).toBe('from\na pipe\n');
    const same = openSync(path('piped.txt'), 'r');
    try {
      const refused = await keyfleet(['encrypt', '--key', 'serials', '--in', '-', '--out', 'piped.txt'], {}, undefined, { fd: same });
      expect({ code: refused.code, stderr: refused.stderr }).toEqual({ code: 1, stderr: 'keyfleet: --out is the same file as --in; write the results elsewhere\n' });
    } finally {
      closeSync(same);
    }
    expect(readFileSync(path('piped.txt'), 'utf8')).toBe('from\na pipe\n');
    const notUtf8 = await keyfleet(['encrypt', '--key', 'serials', '--in', '-', '--out', 'latin1-stdin.enc'], {}, undefined, Buffer.from([0x6f, 0x6b, 0x0a, 0xe9, 0x0a]));
    expect(notUtf8.code).toBe(1);
    expect(notUtf8.stderr).toContain('line 2 of stdin is not UTF-8 text');
  });

  it('exits on an upload refused at its first line, though its stdin is still open', async () => {
    const started = Date.now();
    const refused = await runCli(['encrypt', '--key', 'no-such-key', '--in', '-', '--out', 'refused.enc'], {
      cwd: dir,
      env: { KEYFLEET_URL: url, KEYFLEET_TOKEN: admin.token },
      timeoutMs: 30_000,
      // A slow writer that goes on: one line, and the pipe left open. What it wrote is sent
      // (a file's lines go 256 KB at a time), and refused.
      started: (child) => {
        child.stdin!.on('error', () => {}); // EPIPE once the CLI has gone, as it should
        child.stdin!.write('SN-0000001\n');
      },
    });
    expect({ code: refused.code, stderr: refused.stderr }).toEqual({ code: 1, stderr: expect.stringContaining('KF_KEY_NOT_FOUND') });
    expect(Date.now() - started).toBeLessThan(30_000); // not killed at the time limit
  });

  it('exits on an upload refused at its first bytes, though the named pipe it reads is still open', async () => {
    const fifo = path('input.fifo');
    execFileSync('mkfifo', [fifo]);
    // Opened for writing once the CLI opens it for reading; written to, and left open.
    const writer = createWriteStream(fifo);
    writer.on('error', () => {}); // EPIPE once the CLI has gone
    writer.write('SN-0000001\n'.repeat(40_000));
    try {
      const refused = await keyfleet(['encrypt', '--key', 'no-such-key', '--in', 'input.fifo', '--out', 'refused-fifo.enc']);
      expect({ code: refused.code, stderr: refused.stderr }).toEqual({ code: 1, stderr: expect.stringContaining('KF_KEY_NOT_FOUND') });
    } finally {
      writer.destroy();
    }
  });

  it('refuses a line that is not UTF-8 before the service gets it, naming the line', async () => {
    writeFileSync(path('latin1.txt'), Buffer.concat([Buffer.from('SN-1\nSN-2\nCaf'), Buffer.from([0xe9]), Buffer.from('\nSN-4\n')]));
    const { code, stderr } = await keyfleet(['encrypt', '--key', 'serials', '--in', 'latin1.txt', '--out', 'latin1.enc']);
    expect(code).toBe(1);
    expect(stderr).toContain('keyfleet: line 3 of latin1.txt is not UTF-8 text; give such items as base64 in an NDJSON file (--ndjson --encoding base64)\n');
    expect(stderr).not.toContain('accepted');
    expect(existsSync(path('latin1.enc'))).toBe(false);
    const damaged = await keyfleet(['decrypt', '--key', 'serials', '--in', 'latin1.txt', '--out', 'latin1.dec']);
    expect(damaged.code).toBe(1);
    expect(damaged.stderr).toContain('keyfleet: line 3 of latin1.txt is not UTF-8 text; no ciphertext holds such bytes: the file is damaged\n');
  });

  it('leaves the line of a plaintext with a line break empty in plain output, and counts it failed; --ndjson keeps it', async () => {
    const client = new KeyfleetClient({ url, token: admin.token });
    const sealed = await client.encrypt('serials', ['first', 'two\nlines', 'third']);
    const cts = sealed.kind === 'results' ? sealed.results.map((r) => ('ciphertext' in r ? r.ciphertext : '')) : [];
    writeFileSync(path('multi.enc'), cts.join('\n') + '\n');
    const plain = await keyfleet(['decrypt', '--key', 'serials', '--in', 'multi.enc', '--out', 'multi.dec']);
    expect(plain.code).toBe(2);
    expect(plain.stderr).toContain('line 2: the plaintext holds a line break, which one line of the output cannot (decrypt with --ndjson to get it)');
    expect(plain.stderr).toContain('2 of 3 items decrypted');
    expect(readFileSync(path('multi.dec'), 'utf8')).toBe('first\n\nthird\n');
    writeFileSync(path('multi.ndjson'), cts.map((ct) => JSON.stringify(ct)).join('\n') + '\n');
    const ndjson = await keyfleet(['decrypt', '--key', 'serials', '--ndjson', '--in', 'multi.ndjson', '--out', 'multi.out.ndjson']);
    expect(ndjson.code, ndjson.stderr).toBe(0);
    expect(readFileSync(path('multi.out.ndjson'), 'utf8').trim().split('\n').map((l) => JSON.parse(l))).toEqual(['first', 'two\nlines', 'third']);
  });

  it('decrypts a ciphertext file saved with Windows line ends and a byte order mark', async () => {
    const good = readFileSync(path('serials.enc'), 'utf8').split('\n').slice(0, 3);
    writeFileSync(path('windows.enc'), '\ufeff' + good.join('\r\n') + '\r\n');
    const { code, stderr } = await keyfleet(['decrypt', '--key', 'serials', '--in', 'windows.enc', '--out', 'windows.dec']);
    expect(code, stderr).toBe(0);
    expect(readFileSync(path('windows.dec'), 'utf8')).toBe('SN-0000001-0 ünïcode ✓\nSN-0000002-17wdrqp\nSN-0000003-grnhia\n');
  });

  it('resumes an interrupted download where the output file ends, even mid-line', async () => {
    const full = readFileSync(path('serials.dec'));
    const submitted = await keyfleet(['encrypt', '--key', 'serials', '--in', 'serials.dec', '--out', 'again.enc']);
    expect(submitted.code).toBe(0);
    const batchId = /batch (\S+) accepted/.exec(submitted.stderr)![1]!;
    const complete = readFileSync(path('again.enc'));
    // As if the CLI had died: the file holds 12,345 lines and part of the next.
    const cut = complete.indexOf('\n', complete.indexOf('kf:', 12_345 * 60)) + 20;
    truncateSync(path('again.enc'), cut);
    const resumed = await keyfleet(['encrypt', '--key', 'serials', '--resume', batchId, '--out', 'again.enc']);
    expect(resumed.code).toBe(0);
    const again = readFileSync(path('again.enc'));
    if (!again.equals(complete)) {
      // Say where they part and what each run printed (ciphertexts of test serials, no secrets).
      // latin1 maps every byte to one character, so no difference is lost in decoding.
      const got = again.toString('latin1').split('\n');
      const want = complete.toString('latin1').split('\n');
      let line = 0;
      while (line < want.length && got[line] === want[line]) line++;
      expect({ cut, lines: got.length, line, text: got[line] }, `first run:\n${submitted.stderr}\nresumed:\n${resumed.stderr}`).toEqual({ cut, lines: want.length, line, text: want[line] });
    }
    expect(again.equals(complete)).toBe(true);
    // And those ciphertexts decrypt back to the source.
    await keyfleet(['decrypt', '--key', 'serials', '--in', 'again.enc', '--out', 'again.dec']);
    expect(readFileSync(path('again.dec')).equals(full)).toBe(true);
    // A reader that stops early (`| head`) ends the CLI quietly, with nothing said of the broken pipe.
    const headed = await keyfleet(['batch', 'results', batchId], {}, (child) => child.stdout!.once('data', () => child.stdout!.destroy()));
    expect([headed.code, headed.stderr]).toEqual([0, '']);
  });

  it('keeps an NDJSON input\'s blank lines as blank output lines, so output line n answers input line n, also when resumed', async () => {
    // Blank and whitespace-only lines (the service skips them), a bad item after them, blank lines at the end.
    writeFileSync(path('gaps.ndjson'), '"a"\n\n42\n"b"\n   \n"c"\n\t\n"d"\n\n');
    const run = await keyfleet(['encrypt', '--key', 'serials', '--ndjson', '--in', 'gaps.ndjson', '--out', 'gaps.enc']);
    expect(run.code, run.stderr).toBe(2);
    expect(run.stderr).toContain('line 3: KF_INVALID_ITEM');
    const batchId = /batch (\S+) accepted/.exec(run.stderr)![1]!;
    expect(run.stderr).toContain(`(interrupted? resume with --resume ${batchId} --ndjson --in gaps.ndjson)`);
    const out = readFileSync(path('gaps.enc'), 'utf8').split('\n');
    expect(out.length).toBe(10); // nine lines and the end after the last
    expect(out.map((line) => (line === '' ? '' : line === 'null' ? 'null' : 'ct'))).toEqual(['ct', '', 'null', 'ct', '', 'ct', '', 'ct', '', '']);
    // Cut after input line 5 (a blank one), as if the CLI had died; resumed as its hint says.
    writeFileSync(path('gaps.enc'), out.slice(0, 5).join('\n') + '\n');
    const resumed = await keyfleet(['encrypt', '--key', 'serials', '--resume', batchId, '--ndjson', '--in', 'gaps.ndjson', '--out', 'gaps.enc']);
    expect(resumed.code, resumed.stderr).toBe(2);
    expect(readFileSync(path('gaps.enc'), 'utf8').split('\n')).toEqual(out);
    // Its one failure lies before the resume point: listed by the first run, not this one, and the summary says so.
    expect(resumed.stderr).not.toContain('line 3:');
    expect(resumed.stderr).toMatch(/: 4 of 5 items encrypted into gaps\.enc in [\d.]+ s; 1 failed \(those after line 5 above; the earlier run that wrote lines 1 to 5 listed its own\)\n$/);
    const back = await keyfleet(['decrypt', '--key', 'serials', '--ndjson', '--in', 'gaps.enc', '--out', 'gaps.dec']);
    expect(readFileSync(path('gaps.dec'), 'utf8')).toBe('"a"\n\nnull\n"b"\n\n"c"\n\n"d"\n\n');
    expect(back.stderr).toContain('line 3: KF_INVALID_ITEM');
    // An empty file: an empty output and status 0, and no batch made of it.
    const listed = async () => (await keyfleet(['batch', 'list'])).stdout.trim().split('\n').length;
    const batchesBefore = await listed();
    writeFileSync(path('empty.txt'), '');
    writeFileSync(path('empty.enc'), 'an older file\n');
    const empty = await keyfleet(['encrypt', '--key', 'serials', '--in', 'empty.txt', '--out', 'empty.enc']);
    expect([empty.code, empty.stderr]).toEqual([0, expect.stringMatching(/^keyfleet: 0 of 0 items encrypted into empty\.enc in [\d.]+ s\n$/)]);
    expect(readFileSync(path('empty.enc'), 'utf8')).toBe('');
    expect(await listed()).toBe(batchesBefore);
    // An input that cannot be read is named as the option it came in.
    expect((await keyfleet(['encrypt', '--key', 'serials', '--in', 'no-such.txt', '--out', 'x.enc'])).stderr).toBe('keyfleet: cannot read --in no-such.txt (ENOENT)\n');
    expect((await keyfleet(['encrypt', '--key', 'serials', '--in', '.', '--out', 'x.enc'])).stderr).toBe('keyfleet: cannot read --in .: it is a directory\n');
    // An option of another command is refused at once, by name.
    const misplaced = await keyfleet(['encrypt', '--key', 'serials', '--target-key', 'other', '--in', 'gaps.ndjson', '--out', 'gaps.other']);
    expect([misplaced.code, misplaced.stderr]).toEqual([1, expect.stringContaining("error: unknown option '--target-key'")]);
    expect((await keyfleet(['rewrap', '--key', 'serials', '--encoding', 'base64', '--in', 'gaps.enc', '--out', 'gaps.other'])).stderr).toContain("error: unknown option '--encoding'");
    // `-` for --out would be a file of that name: refused before anything is sent.
    const dash = await keyfleet(['encrypt', '--key', 'serials', '--in', 'gaps.ndjson', '--out', '-']);
    expect([dash.code, dash.stderr]).toEqual([1, 'keyfleet: --out - is not taken: the results go to a file, which --resume can append to (`keyfleet batch results <id>` writes them to stdout)\n']);
    expect(existsSync(path('-'))).toBe(false);
  });

  it('refuses to resume a batch of another operation or key, writing nothing', async () => {
    const submitted = await keyfleet(['encrypt', '--key', 'serials', '--in', 'mixed.dec', '--out', 'op.enc']);
    const batchId = /batch (\S+) accepted/.exec(submitted.stderr)![1]!;
    const asDecrypt = await keyfleet(['decrypt', '--key', 'serials', '--resume', batchId, '--out', 'op.dec']);
    expect(asDecrypt.code).toBe(1);
    // At once: no progress of a batch it will not download.
    expect(asDecrypt.stderr).toBe(`keyfleet: batch ${batchId} is encrypt under key serials, not decrypt under key serials\n`);
    expect(existsSync(path('op.dec'))).toBe(false);
  });

  it('manages keys and batches: keys list/show/rotate, batch list/status/results/cancel', async () => {
    const rotated = await keyfleet(['keys', 'rotate', 'serials']);
    expect(JSON.parse(rotated.stdout)).toMatchObject({ name: 'serials', latestVersion: 2 });
    expect(JSON.parse((await keyfleet(['keys', 'show', 'serials'])).stdout).latestVersion).toBe(2);
    await keyfleet(['keys', 'create', 'a-first']);
    const listed = await keyfleet(['keys', 'list']);
    expect(listed.code, listed.stderr).toBe(0);
    const lines = listed.stdout.trim().split('\n').map((l) => JSON.parse(l) as { name: string; latestVersion: number });
    expect(lines.map((k) => k.name)).toEqual([...lines.map((k) => k.name)].sort());
    expect(lines).toContainEqual(expect.objectContaining({ name: 'serials', latestVersion: 2 }));
    expect(lines[0]).toMatchObject({ name: 'a-first', latestVersion: 1 });
    writeFileSync(path('three.txt'), 'a\nb\nc\n');
    const run = await keyfleet(['encrypt', '--key', 'serials', '--in', 'three.txt', '--out', 'three.enc']);
    const batchId = /batch (\S+) accepted/.exec(run.stderr)![1]!;
    expect(run.code, run.stderr).toBe(0);
    const newest = await keyfleet(['batch', 'list', '--limit', '1']);
    expect(newest.code, newest.stderr).toBe(0);
    expect(newest.stdout.trim().split('\n').map((l) => JSON.parse(l))).toEqual([expect.objectContaining({ id: batchId, op: 'encrypt', key: 'serials', status: 'completed', total: 3 })]);
    expect((await keyfleet(['batch', 'list'])).stdout.trim().split('\n').length).toBeGreaterThan(5);
    const status = await keyfleet(['batch', 'status', batchId]);
    expect(status.code, status.stderr).toBe(0);
    expect(JSON.parse(status.stdout)).toMatchObject({ id: batchId, status: 'completed', total: 3 });
    const results = (await keyfleet(['batch', 'results', batchId, '--from', '1'])).stdout.trim().split('\n').map((l) => JSON.parse(l));
    expect(results.map((r) => r.i)).toEqual([1, 2]);
    expect(results[0].ciphertext).toMatch(/^kf:v2:/);
    // --out holds exactly the lines fetched, whatever the file held before.
    writeFileSync(path('lines.ndjson'), 'an older, longer file\n'.repeat(50));
    expect((await keyfleet(['batch', 'results', batchId, '--from', '2', '--out', 'lines.ndjson'])).code).toBe(0);
    expect(readFileSync(path('lines.ndjson'), 'utf8').trim().split('\n').map((l) => JSON.parse(l).i)).toEqual([2]);
    // A device or a pipe is written to, not emptied first (it cannot be).
    expect((await keyfleet(['batch', 'results', batchId, '--out', '/dev/null'])).code).toBe(0);
    expect(JSON.parse((await keyfleet(['batch', 'cancel', batchId])).stdout).id).toBe(batchId);
    const gone = await keyfleet(['batch', 'results', batchId]);
    expect(gone.code).toBe(1);
    expect(gone.stderr).toContain('KF_BATCH_DELETED');
    // A batch with no results to give leaves the file named by --out as it was.
    for (const id of [batchId, 'NoSuchBatch0000000']) {
      const kept = await keyfleet(['batch', 'results', id, '--out', 'lines.ndjson']);
      expect(kept.code, id).toBe(1);
      expect(readFileSync(path('lines.ndjson'), 'utf8').trim().split('\n').map((l) => JSON.parse(l).i)).toEqual([2]);
    }
  });
});

describe('the worker process', () => {
  it.runIf(process.platform === 'linux' && nativeKernel !== undefined)('runs every thread under SCHED_IDLE at nice 19 (WORKER_SCHED=idle, WORKER_NICE=19)', () => {
    const pid = worker.child.pid!;
    // /proc/<pid>/task/<tid>/stat after the command name: field 19 is the niceness, 41 the policy.
    const stats = readdirSync(`/proc/${pid}/task`).map((t) => readFileSync(`/proc/${pid}/task/${t}/stat`, 'utf8').split(') ')[1]!.split(' '));
    expect(stats.length).toBeGreaterThan(5);
    expect(new Set(stats.map((f) => Number(f[38])))).toEqual(new Set([5])); // SCHED_IDLE
    expect(new Set(stats.map((f) => Number(f[16])))).toEqual(new Set([19]));
  });
});

describe('the typed client', () => {
  it('covers the routes with typed answers and KF_ errors', async () => {
    const client = new KeyfleetClient({ url, token: admin.token });
    expect(await client.health()).toBe(true);
    expect(await client.ready()).toBe(true);
    const sealed = await client.encrypt('serials', ['one', 'two']);
    expect(sealed.kind).toBe('results');
    const cts = sealed.kind === 'results' ? sealed.results.map((r) => ('ciphertext' in r ? r.ciphertext : '')) : [];
    const opened = await client.decrypt('serials', cts);
    expect(opened.kind === 'results' && opened.results).toEqual([{ plaintext: 'one' }, { plaintext: 'two' }]);
    const batch = await client.createBatch({ op: 'encrypt', key: 'serials' }, () => ['x', 'y', 'z']);
    const final = await client.waitForBatch(batch.batchId);
    expect(final).toMatchObject({ status: 'completed', succeeded: 3 });
    const lines = [];
    for await (const line of client.results(batch.batchId, { from: 1 })) lines.push(line);
    expect(lines.map((l) => l.i)).toEqual([1, 2]);
    const error = await client.getKey('missing').catch((e: unknown) => e);
    expect(error).toBeInstanceOf(KeyfleetApiError);
    expect(error).toMatchObject({ status: 404, code: 'KF_KEY_NOT_FOUND' });
  });

  it('gets the answer to a large upload refused before its body is read, not a broken pipe', async () => {
    // The API answers 404 at once and stops reading; the client is still sending megabytes. Closed
    // right after the answer, the connection was reset under the client's writes, and fetch
    // failed with EPIPE (6 of 6 at 16 MB before the API closed in stages).
    const client = new KeyfleetClient({ url, token: admin.token });
    const piece = `${JSON.stringify('LIC-0000-0000-0000-0000-0000-0000')}\n`.repeat(7_000); // 252 KB
    for (let attempt = 0; attempt < 3; attempt++) {
      const refused = await client.createBatchFromNdjson({ op: 'encrypt', key: 'no-such-key' }, function* () {
        for (let n = 0; n < 64; n++) yield piece;
      }).catch((e: unknown) => e);
      expect(refused).toBeInstanceOf(KeyfleetApiError);
      expect(refused).toMatchObject({ status: 404, code: 'KF_KEY_NOT_FOUND' });
    }
  });

  it('waits for a batch across broken and ended event streams, and stops at an answer', async () => {
    // A stand-in API: a gateway answers 502 first (the API behind it restarting), then the first
    // stream breaks after one event, the second ends cleanly without the final one, the third
    // gives it. Another batch is not found.
    const status = (processed: number, state: string) => JSON.stringify({ id: 'b1', op: 'encrypt', key: 'k', status: state, total: 10, processed, succeeded: processed, failed: 0, createdAt: new Date().toISOString() });
    let streams = 0;
    let neverDone = false;
    const server: Server = createServer((req, res) => {
      if (!req.url!.startsWith('/v1/batches/b1/')) {
        res.writeHead(404, { 'content-type': 'application/json' }).end(JSON.stringify({ error: { code: 'KF_BATCH_NOT_FOUND', message: 'no such batch' } }));
        return;
      }
      streams++;
      if (streams === 1 && !neverDone) {
        res.writeHead(502, { 'content-type': 'text/plain' }).end('Bad Gateway');
        return;
      }
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      if (neverDone) res.end(`event: status\ndata: ${status(9, 'running')}\n\n`);
      else if (streams === 2) res.write(`event: status\ndata: ${status(3, 'running')}\n\n`, () => res.destroy());
      else if (streams === 3) res.end(`event: status\ndata: ${status(6, 'running')}\n\n`);
      else res.end(`event: status\ndata: ${status(8, 'running')}\n\nevent: done\ndata: ${status(10, 'completed')}\n\n`);
    });
    await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
    try {
      const client = new KeyfleetClient({ url: `http://127.0.0.1:${(server.address() as { port: number }).port}`, token: STAND_IN_TOKEN, retry: { baseDelayMs: 10, maxDelayMs: 20 } });
      const seen: number[] = [];
      const final = await client.waitForBatch('b1', (s) => seen.push(s.processed));
      expect(final).toMatchObject({ status: 'completed', processed: 10 });
      expect(seen).toEqual([3, 6, 8, 10]);
      expect(streams).toBe(4);
      await expect(client.waitForBatch('b2')).rejects.toMatchObject({ status: 404, code: 'KF_BATCH_NOT_FOUND' });
      // A stream that keeps ending without news is given up after `reconnects` tries in a row.
      // A URL nothing answers fails at once, unless the API answered before (the CLI's upload).
      const closed = new KeyfleetClient({ url: `http://127.0.0.1:${await freePort()}`, token: STAND_IN_TOKEN, retry: { baseDelayMs: 10, maxDelayMs: 20 } });
      await expect(closed.waitForBatch('b1')).rejects.toBeInstanceOf(KeyfleetConnectionError);
      await expect(closed.waitForBatch('b1', undefined, { apiReached: true, reconnects: 2 })).rejects.toThrow(/^batch b1: the event stream broke \(cannot reach .* \(ECONNREFUSED\)\), 2 reconnections in a row failed$/);
      neverDone = true;
      streams = 0;
      await expect(client.waitForBatch('b1', undefined, { reconnects: 2 })).rejects.toThrow('batch b1: the event stream ended without a final status, 2 reconnections in a row failed');
      expect(streams).toBe(3);
    } finally {
      server.closeAllConnections();
      await new Promise((ok) => server.close(ok));
    }
  });

  it('fails to connect with a KeyfleetConnectionError that names the URL, without retrying; a failing upload source gives its own error', async () => {
    let connections = 0;
    const sockets = new Set<Socket>();
    // Cut once the request is in, like an API that dies mid-request. (Cut before it, and fetch can hang.)
    const server = createTcpServer((socket) => {
      connections++;
      sockets.add(socket.once('close', () => sockets.delete(socket)));
      socket.once('data', () => socket.destroy());
    });
    await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
    try {
      const cutting = `http://127.0.0.1:${(server.address() as { port: number }).port}`;
      const cut = await new KeyfleetClient({ url: cutting, token: STAND_IN_TOKEN, retry: { attempts: 3 } }).getKey('k').catch((e: unknown) => e);
      expect(cut).toBeInstanceOf(KeyfleetConnectionError);
      expect(cut).toMatchObject({ url: cutting, message: `cannot reach ${cutting} (other side closed)` });
      expect(connections).toBe(1);
      // No status, unlike an answer's error: the CLI's download retries these from where its file ends.
      expect(cut).not.toHaveProperty('status');

      // A connection was made: an upload whose own source fails gives that error back, not a connection error.
      const broken = new Error('the source broke');
      const upload = new KeyfleetClient({ url: cutting, token: STAND_IN_TOKEN }).createBatch({ op: 'encrypt', key: 'k' }, function* () {
        yield 'a';
        throw broken;
      });
      await expect(upload).rejects.toBe(broken);
    } finally {
      // After a failed upload undici opens a spare connection that sends nothing; close() would wait for it.
      for (const socket of sockets) socket.destroy();
      await new Promise((ok) => server.close(ok));
    }
    const closed = `http://127.0.0.1:${await freePort()}`;
    await expect(new KeyfleetClient({ url: closed, token: STAND_IN_TOKEN }).ready()).rejects.toMatchObject({ name: 'KeyfleetConnectionError', message: `cannot reach ${closed} (ECONNREFUSED)` });
  });

  it('retries 429 and 503 honouring Retry-After (seconds or HTTP date), then gives up', async () => {
    expect(retryDelayMs(1, '2')).toBe(2000);
    expect(retryDelayMs(1, new Date(Date.now() + 3_000).toUTCString())).toBeGreaterThan(1_000);
    const arrivals: number[] = [];
    let answer503 = 1;
    const server: Server = createServer((_req, res) => {
      arrivals.push(Date.now());
      if (answer503-- > 0) {
        res.writeHead(503, { 'retry-after': '1', 'content-type': 'application/json' }).end('{"error":{"code":"KF_REDIS_UNAVAILABLE","message":"later"}}');
        return;
      }
      res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify({ name: 'k', type: 'aes256-gcm96', convergent: false, latestVersion: 1, minDecryptionVersion: 1, minEncryptionVersion: 1, deletionAllowed: false, autoRotatePeriod: 0, createdAt: 'now' }));
    });
    await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
    try {
      const { port } = server.address() as { port: number };
      const client = new KeyfleetClient({ url: `http://127.0.0.1:${port}`, token: STAND_IN_TOKEN, retry: { attempts: 3 } });
      expect((await client.getKey('k')).name).toBe('k');
      expect(arrivals).toHaveLength(2);
      // The client waited at least what the server asked for.
      expect(arrivals[1]! - arrivals[0]!).toBeGreaterThanOrEqual(950);
      answer503 = 10;
      arrivals.length = 0;
      const fast = new KeyfleetClient({ url: `http://127.0.0.1:${port}`, token: STAND_IN_TOKEN, retry: { attempts: 2, maxDelayMs: 10 } });
      await expect(fast.getKey('k')).rejects.toMatchObject({ status: 503, code: 'KF_REDIS_UNAVAILABLE' });
      expect(arrivals).toHaveLength(2);
    } finally {
      await new Promise((ok) => server.close(ok));
    }
  });
});
