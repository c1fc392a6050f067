import { createServer, type IncomingMessage, type Server, type ServerResponse } from 'node:http';
import { execFileSync } from 'node:child_process';
import { closeSync, constants, existsSync, mkdtempSync, openSync, rmSync, writeFileSync } from 'node:fs';
import { writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, afterEach, describe, expect, it } from 'vitest';
import { KeyfleetClient, KeyfleetConnectionError, KeyfleetTimeoutError } from '../../client/index.js';
import { runCli } from '../helpers/cli.js';
import { STAND_IN_TOKEN } from '../helpers/env.js';

// How long the client waits on an API that does not answer, or stops answering: stand-in APIs
// on loopback that hold a request, a body or a stream as a hung API (or a gateway before one)
// would. Each test has its own short time limit: without the client's own, each would hang.
const servers = new Set<Server>();
const dir = mkdtempSync(join(tmpdir(), 'keyfleet-timeouts-'));
afterEach(async () => {
  for (const server of servers) {
    server.closeAllConnections();
    await new Promise((ok) => server.close(ok));
  }
  servers.clear();
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** A stand-in API on loopback; closed after the test. */
async function standIn(handler: (req: IncomingMessage, res: ServerResponse) => void): Promise<string> {
  const server = createServer(handler);
  servers.add(server);
  await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
  return `http://127.0.0.1:${(server.address() as { port: number }).port}`;
}

/** A stand-in API that reads every request and never answers; `requests` holds each one's headers. */
async function silentApi(): Promise<{ url: string; requests: IncomingMessage['headers'][] }> {
  const requests: IncomingMessage['headers'][] = [];
  const url = await standIn((req) => {
    requests.push(req.headers);
    req.resume(); // read, never answered
  });
  return { url, requests };
}

const status = (processed: number) => JSON.stringify({ id: 'b1', op: 'encrypt', key: 'k', status: 'running', total: 10, processed, succeeded: processed, failed: 0, createdAt: new Date().toISOString() });
const sleep = (ms: number) => new Promise((ok) => setTimeout(ok, ms));

describe('the typed client’s time limits', () => {
  it('gives up on an API that sends no answer after timeoutMs, naming the call and the wait, and sends a rotation once', { timeout: 10_000 }, async () => {
    const { url, requests } = await silentApi();
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, timeoutMs: 300, retry: { baseDelayMs: 10 } });
    const started = Date.now();
    const rotated = await client.rotateKey('serials').catch((e: unknown) => e);
    expect(Date.now() - started).toBeLessThan(3_000);
    expect(rotated).toBeInstanceOf(KeyfleetTimeoutError);
    // No status, as a broken connection: the CLI's download and waitForBatch go on after one.
    expect(rotated).toBeInstanceOf(KeyfleetConnectionError);
    expect(rotated).not.toHaveProperty('status');
    // A rotation not answered may have been done: it is not sent again.
    expect((rotated as Error).message).toBe(`POST /v1/keys/serials/rotate: no answer from ${url} within 0.3 s; the API may have done it`);
    expect(requests).toHaveLength(1);
    const read = await client.getKey('serials').catch((e: unknown) => e);
    expect((read as Error).message).toBe(`GET /v1/keys/serials: no answer from ${url} within 0.3 s`);
    await expect(client.ready()).rejects.toBeInstanceOf(KeyfleetTimeoutError);
  });

  it('says a call that changes something may have been done when its answer does not come, whether or not it is safe to repeat', { timeout: 10_000 }, async () => {
    const { url, requests } = await silentApi();
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, timeoutMs: 300, retry: { baseDelayMs: 10 } });
    const messageOf = (call: Promise<unknown>) => call.then(() => 'answered', (e: unknown) => (e as Error).message);
    // A policy change and a trim set values (safe to repeat), and are done all the same.
    expect(await messageOf(client.patchKey('serials', { deletionAllowed: true }))).toBe(`PATCH /v1/keys/serials: no answer from ${url} within 0.3 s; the API may have done it`);
    expect(await messageOf(client.trimKey('serials', 2))).toBe(`POST /v1/keys/serials/trim: no answer from ${url} within 0.3 s; the API may have done it`);
    // A sync crypto call changes nothing.
    expect(await messageOf(client.encrypt('serials', ['a'], { mode: 'sync' }))).toBe(`POST /v1/encrypt/serials: no answer from ${url} within 0.3 s`);
    expect(requests).toHaveLength(3);
  });

  it('sends a call with an Idempotency-Key again after a timeout, with the same key, and gets the one answer', { timeout: 10_000 }, async () => {
    const keys: string[] = [];
    const url = await standIn((req, res) => {
      keys.push(String(req.headers['idempotency-key']));
      req.resume().on('end', () => {
        if (keys.length % 2 === 1) return; // each call's first attempt: read whole, never answered
        if (req.url!.startsWith('/v1/keys/')) return void res.writeHead(201, { 'content-type': 'application/json' }).end(JSON.stringify({ name: 'k', type: 'aes256-gcm96', convergent: false, latestVersion: 1, minDecryptionVersion: 1, minEncryptionVersion: 1, deletionAllowed: false, autoRotatePeriod: 0, createdAt: 'now' }));
        res.writeHead(202, { 'content-type': 'application/json' }).end(JSON.stringify({ batchId: 'Once1234Once5678', status: 'queued', total: 2 }));
      });
    });
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, timeoutMs: 300, retry: { baseDelayMs: 10 } });
    expect(await client.createBatch({ op: 'encrypt', key: 'k' }, () => ['a', 'b'])).toMatchObject({ batchId: 'Once1234Once5678' });
    expect(await client.createBatchFromNdjson({ op: 'encrypt', key: 'k', idempotencyKey: 'upload-1' }, function* () {
      yield '"a"\n"b"\n';
    })).toMatchObject({ batchId: 'Once1234Once5678' });
    expect(await client.encrypt('k', ['a', 'b'], { mode: 'async' })).toMatchObject({ kind: 'batch', batchId: 'Once1234Once5678' });
    expect(await client.createKey('k')).toMatchObject({ created: true });
    expect(keys).toHaveLength(8);
    for (let call = 0; call < 4; call++) {
      expect(keys[2 * call]).toMatch(/^[\w-]{8,}$/);
      expect(keys[2 * call + 1]).toBe(keys[2 * call]);
    }
    expect(keys[2]).toBe('upload-1');
  });

  it('says a call with an Idempotency-Key that timed out at every attempt may have been done, and names the key to send it again with', { timeout: 10_000 }, async () => {
    const keys: (string | undefined)[] = [];
    const url = await standIn((req) => {
      keys.push(req.headers['idempotency-key'] as string | undefined);
      if (req.url!.includes('key=stalled-second') && keys.length === 2) return void req.pause(); // takes nothing
      req.resume(); // read, never answered
    });
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, timeoutMs: 300, idleTimeoutMs: 300, retry: { attempts: 2, baseDelayMs: 10 } });
    const upload = await client.createBatch({ op: 'encrypt', key: 'k' }, () => ['a', 'b']).catch((e: unknown) => e);
    expect(keys).toHaveLength(2);
    expect(keys[1]).toBe(keys[0]);
    expect(upload).toBeInstanceOf(KeyfleetTimeoutError);
    expect(upload).toMatchObject({ idempotencyKey: keys[0], maybeDone: true });
    expect((upload as Error).message).toBe(`POST /v1/batches: no answer from ${url} within 0.3 s; the API may have done it (send it again with Idempotency-Key ${keys[0]} to get its answer without doing it twice)`);

    keys.length = 0;
    const given = await client.encrypt('k', ['a'], { idempotencyKey: 'order-7' }).catch((e: unknown) => e);
    expect(keys).toEqual(['order-7', 'order-7']);
    expect((given as Error).message).toBe(`POST /v1/encrypt/k: no answer from ${url} within 0.3 s; the API may have done it (send it again with Idempotency-Key order-7 to get its answer without doing it twice)`);

    // Cut short at its second attempt, it says so too: the first was sent whole.
    keys.length = 0;
    let uploads = 0;
    const piece = `${JSON.stringify('LIC-0000-0000-0000-0000-0000-0000')}\n`.repeat(7_000); // 252 KB
    const stalled = await client.createBatchFromNdjson({ op: 'encrypt', key: 'stalled-second' }, function* () {
      if (uploads++ === 0) return void (yield piece);
      for (let n = 0; n < 256; n++) yield piece; // up to 64 MB, made only as it is taken
    }).catch((e: unknown) => e);
    expect(keys).toHaveLength(2);
    expect((stalled as Error).message).toBe(`POST /v1/batches: ${url} took no more of the upload for 0.3 s; the API may have done it (send it again with Idempotency-Key ${keys[0]} to get its answer without doing it twice)`);

    // Without a key, a call that is not safe to repeat is sent once.
    keys.length = 0;
    const rotation = await client.rotateKey('k').catch((e: unknown) => e);
    expect(keys).toEqual([undefined]);
    expect(rotation).toMatchObject({ idempotencyKey: undefined, maybeDone: true });
  });

  it('names the Idempotency-Key of a call still running when its attempts ran out (409 KF_IDEMPOTENCY_IN_PROGRESS)', { timeout: 10_000 }, async () => {
    const keys: string[] = [];
    const url = await standIn((req, res) => {
      keys.push(String(req.headers['idempotency-key']));
      req.resume().on('end', () => res.writeHead(409, { 'retry-after': '1', 'content-type': 'application/json' }).end('{"error":{"code":"KF_IDEMPOTENCY_IN_PROGRESS","message":"a request with this Idempotency-Key is still in progress; retry later"}}'));
    });
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, retry: { attempts: 2, maxDelayMs: 10 } });
    const running = await client.createBatch({ op: 'encrypt', key: 'k' }, () => ['a']).catch((e: unknown) => e);
    expect(keys).toHaveLength(2);
    expect(running).toMatchObject({ status: 409, code: 'KF_IDEMPOTENCY_IN_PROGRESS' });
    expect((running as Error).message).toBe(`KF_IDEMPOTENCY_IN_PROGRESS (HTTP 409): a request with this Idempotency-Key is still in progress; retry later (send it again with Idempotency-Key ${keys[0]} to get its answer without doing it twice)`);
  });

  it('refuses a time limit that is not a positive number of milliseconds, naming the option', () => {
    for (const timeoutMs of [0, -1, Number.NaN, 2 ** 31]) {
      expect(() => new KeyfleetClient({ url: 'http://127.0.0.1:1', token: STAND_IN_TOKEN, timeoutMs })).toThrow(/^keyfleet client: timeoutMs must be/);
      expect(() => new KeyfleetClient({ url: 'http://127.0.0.1:1', token: STAND_IN_TOKEN, idleTimeoutMs: timeoutMs })).toThrow(/^keyfleet client: idleTimeoutMs must be/);
    }
  });

  it('downloads results for longer than either limit while they keep coming, and fails a download that goes silent', { timeout: 10_000 }, async () => {
    const url = await standIn(async (req, res) => {
      res.writeHead(200, { 'content-type': 'application/x-ndjson' });
      for (let i = 0; i < (req.url!.includes('/b1/') ? 12 : 2); i++) {
        res.write(`{"i":${i},"ciphertext":"kf:v1:AAAA"}\n`);
        await sleep(100);
      }
      if (req.url!.includes('/b1/')) res.end(); // b2 goes silent
    });
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, timeoutMs: 300, idleTimeoutMs: 400 });
    const started = Date.now();
    const all = [];
    for await (const line of client.results('b1')) all.push(line.i);
    expect(all).toEqual([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    expect(Date.now() - started).toBeGreaterThan(1_000);

    const some: number[] = [];
    const silent = await (async () => {
      for await (const line of client.results('b2')) some.push(line.i);
    })().catch((e: unknown) => e);
    expect(some).toEqual([0, 1]);
    expect(silent).toBeInstanceOf(KeyfleetTimeoutError);
    expect((silent as Error).message).toBe(`GET /v1/batches/b2/results: the answer from ${url} stopped for 0.4 s`);
  });

  it('ends a wait for a batch whose event stream goes silent, and stops a wait at its AbortSignal', { timeout: 10_000 }, async () => {
    let streams = 0;
    const url = await standIn((_req, res) => {
      streams++;
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      res.write(`event: progress\ndata: ${status(3)}\n\n`); // then nothing, not even a keep-alive
    });
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, idleTimeoutMs: 300, retry: { baseDelayMs: 10, maxDelayMs: 20 } });
    const started = Date.now();
    await expect(client.waitForBatch('b1', undefined, { reconnects: 1 })).rejects.toThrow(`batch b1: the event stream broke (GET /v1/batches/b1/events: the answer from ${url} stopped for 0.3 s), 1 reconnections in a row failed`);
    expect(streams).toBe(2);
    expect(Date.now() - started).toBeLessThan(3_000);

    // The caller's own limit: a signal ends the wait, however patient the client's limits are.
    const patient = new KeyfleetClient({ url, token: STAND_IN_TOKEN, idleTimeoutMs: 60_000 });
    const stop = new AbortController();
    setTimeout(() => stop.abort(), 200);
    const aborted = await patient.waitForBatch('b1', undefined, { signal: stop.signal }).catch((e: unknown) => e);
    expect(aborted).toMatchObject({ name: 'AbortError' });
    expect(Date.now() - started).toBeLessThan(4_000);
  });

  it('gives up on an upload the API stops taking, and on an answer that never comes after it; a slow source is not the API’s silence', { timeout: 10_000 }, async () => {
    const url = await standIn((req, res) => {
      if (req.url!.includes('key=stalled')) return void req.pause(); // takes nothing: the connection fills up
      req.resume().on('end', () => {
        if (req.url!.includes('key=slow')) res.writeHead(202, { 'content-type': 'application/json' }).end(JSON.stringify({ batchId: 'Slow1234Slow5678', status: 'queued', total: 3 }));
      }); // key=unanswered: read to the end, never answered
    });
    // One attempt: an upload's key would have it sent again after a timeout.
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, timeoutMs: 300, idleTimeoutMs: 300, retry: { attempts: 1 } });
    const piece = `${JSON.stringify('LIC-0000-0000-0000-0000-0000-0000')}\n`.repeat(7_000); // 252 KB
    const stalled = await client.createBatchFromNdjson({ op: 'encrypt', key: 'stalled' }, function* () {
      for (let n = 0; n < 256; n++) yield piece; // up to 64 MB, made only as it is taken
    }).catch((e: unknown) => e);
    expect(stalled).toBeInstanceOf(KeyfleetTimeoutError);
    // Cut short, at its first attempt: the API makes no batch of it.
    expect((stalled as Error).message).toBe(`POST /v1/batches: ${url} took no more of the upload for 0.3 s`);

    const unanswered = await client.createBatch({ op: 'encrypt', key: 'unanswered' }, () => ['a', 'b']).catch((e: unknown) => e);
    // Sent whole: the API may have made the batch, and the key of the client's own gets it.
    const { idempotencyKey } = unanswered as KeyfleetTimeoutError;
    expect((unanswered as Error).message).toBe(`POST /v1/batches: no answer from ${url} within 0.3 s; the API may have done it (send it again with Idempotency-Key ${idempotencyKey} to get its answer without doing it twice)`);

    // Pieces 0.5 s apart, longer than both limits: the client waits on its own input, not on the API.
    const slow = await client.createBatch({ op: 'encrypt', key: 'slow' }, async function* () {
      for (const item of ['a', 'b', 'c']) {
        await sleep(500);
        yield item;
      }
    });
    expect(slow.batchId).toBe('Slow1234Slow5678');
  });

  it('keeps the answer’s idle limit while an upload the API answered early is still being sent', { timeout: 10_000 }, async () => {
    // The API answers at once (202 and its headers), then sends no body, while the upload goes on.
    const url = await standIn((req, res) => {
      req.resume();
      res.writeHead(202, { 'content-type': 'application/json' }).flushHeaders();
    });
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, timeoutMs: 300, idleTimeoutMs: 300 });
    const started = Date.now();
    // A piece every 0.1 s for 5 s: the caller's own limit of 4 s ends it if the client's does not.
    const answer = await client.createBatchFromNdjson({ op: 'encrypt', key: 'early', signal: AbortSignal.timeout(4_000) }, async function* () {
      for (let n = 0; n < 50; n++) {
        await sleep(100);
        yield '"a"\n';
      }
    }).catch((e: unknown) => e);
    expect(answer).toBeInstanceOf(KeyfleetTimeoutError);
    expect((answer as Error).message).toMatch(new RegExp(`^POST /v1/batches: the answer from ${url} stopped for 0\\.3 s`));
    expect(Date.now() - started).toBeLessThan(2_000);
  });
});

describe('the caller’s AbortSignal', () => {
  it('ends a call with the signal’s reason, whether it aborts during the request or during the wait before a retry', { timeout: 10_000 }, async () => {
    let requests = 0;
    const url = await standIn((req, res) => {
      requests++;
      if (req.url!.endsWith('/held')) return void req.resume(); // never answered
      if (req.url!.endsWith('/events')) return void res.writeHead(200, { 'content-type': 'text/event-stream' }).end(); // ends without a final status
      res.writeHead(503, { 'retry-after': '5', 'content-type': 'application/json' }).end('{"error":{"code":"KF_REDIS_UNAVAILABLE","message":"later"}}');
    });
    const client = new KeyfleetClient({ url, token: STAND_IN_TOKEN, retry: { baseDelayMs: 5_000 } });
    const abortedWith = async (call: (signal: AbortSignal) => Promise<unknown>) => {
      const stop = new AbortController();
      const reason = new Error('the caller had enough');
      setTimeout(() => stop.abort(reason), 200);
      const started = Date.now();
      const outcome = await call(stop.signal).catch((e: unknown) => e);
      expect(Date.now() - started).toBeLessThan(2_000);
      return { outcome, reason };
    };
    // During the request: fetch rejects with the reason.
    let { outcome, reason } = await abortedWith((signal) => client.encrypt('held', ['a'], { mode: 'sync', signal }));
    expect(outcome).toBe(reason);
    // During the wait before a retry (Retry-After: 5), of a call and of a wait for a batch.
    ({ outcome, reason } = await abortedWith((signal) => client.encrypt('k', ['a'], { mode: 'sync', signal })));
    expect(outcome).toBe(reason);
    ({ outcome, reason } = await abortedWith((signal) => client.waitForBatch('b1', undefined, { signal })));
    expect(outcome).toBe(reason);
    expect(requests).toBe(3);
    // AbortSignal.timeout's reason is a TimeoutError, the same either way.
    const timedOut = await client.encrypt('k', ['a'], { mode: 'sync', signal: AbortSignal.timeout(200) }).catch((e: unknown) => e);
    expect(timedOut).toMatchObject({ name: 'TimeoutError' });
  });
});

describe('the CLI’s --timeout', () => {
  it('takes seconds, says which call timed out and that a rotation may have been done, and refuses a value that is no number of seconds', { timeout: 15_000 }, async () => {
    const { url } = await silentApi();
    const run = await runCli(['--timeout', '0.5', 'keys', 'rotate', 'serials'], { cwd: dir, env: { KEYFLEET_URL: url, KEYFLEET_TOKEN: STAND_IN_TOKEN }, timeoutMs: 10_000 });
    expect(run.code).toBe(1);
    expect(run.stderr).toBe(`keyfleet: POST /v1/keys/serials/rotate: no answer from ${url} within 0.5 s; the API may have done it\n`);
    const fromEnv = await runCli(['keys', 'show', 'serials'], { cwd: dir, env: { KEYFLEET_URL: url, KEYFLEET_TOKEN: STAND_IN_TOKEN, KEYFLEET_TIMEOUT: '0.5' }, timeoutMs: 10_000 });
    expect(fromEnv.stderr).toBe(`keyfleet: GET /v1/keys/serials: no answer from ${url} within 0.5 s\n`);
    const bad = await runCli(['--timeout', 'soon', 'keys', 'show', 'serials'], { cwd: dir, env: { KEYFLEET_URL: url, KEYFLEET_TOKEN: STAND_IN_TOKEN }, timeoutMs: 10_000 });
    expect(bad.code).toBe(1);
    expect(bad.stderr).toContain('--timeout');
    expect(bad.stderr).toContain('expected a number of seconds > 0');
  });

  it('tells of an upload that timed out how to get the batch the service may have made, rather than make a second one', { timeout: 30_000 }, async () => {
    const keys: string[] = [];
    const url = await standIn((req) => {
      keys.push(String(req.headers['idempotency-key']));
      req.resume(); // read, never answered
    });
    writeFileSync(join(dir, 'two.txt'), 'a\nb\n');
    const env = { KEYFLEET_URL: url, KEYFLEET_TOKEN: STAND_IN_TOKEN };
    const encrypt = ['--timeout', '0.3', 'encrypt', '--key', 'k', '--in', 'two.txt', '--out', 'two.enc'];
    const run = await runCli(encrypt, { cwd: dir, env, timeoutMs: 20_000 });
    expect(run.code).toBe(1);
    // Sent again with the same key on every attempt (5), then the key is named.
    expect(keys).toHaveLength(5);
    expect(new Set(keys).size).toBe(1);
    expect(run.stderr, run.stderr).toMatch(new RegExp(`\nkeyfleet: POST /v1/batches: no answer from ${url} within 0\\.3 s; the service may have made the batch: run the same command again with --idempotency-key ${keys[0]} to get it rather than a second one\n$`));
    expect(existsSync(join(dir, 'two.enc'))).toBe(false);

    // Run so, it sends that key.
    const named = keys[0]!;
    keys.length = 0;
    const again = await runCli([...encrypt, '--idempotency-key', named], { cwd: dir, env, timeoutMs: 20_000 });
    expect(new Set(keys)).toEqual(new Set([named]));
    expect(again.stderr).toContain(`run the same command again with --idempotency-key ${named} to get it rather than a second one`);

    // An input that cannot be read twice (a named pipe) cannot be sent again: the message still names the key.
    keys.length = 0;
    const fifo = join(dir, 'input.fifo');
    execFileSync('mkfifo', [fifo]);
    const feeding = writeFile(fifo, 'a\nb\n'); // once the CLI opens it
    const piped = await runCli(['--timeout', '0.3', 'encrypt', '--key', 'k', '--in', 'input.fifo', '--out', 'piped.enc'], { cwd: dir, env, timeoutMs: 20_000 });
    // Had the CLI not opened it, the writer would wait for ever: a reader of our own lets it go.
    closeSync(openSync(fifo, constants.O_RDONLY | constants.O_NONBLOCK));
    await feeding.catch(() => {});
    expect(piped.code).toBe(1);
    expect(keys, piped.stderr).toHaveLength(1);
    expect(piped.stderr).toContain(`save the input to a file and run again with --idempotency-key ${keys[0]}`);
  });

  it('reads an empty or blank KEYFLEET_TIMEOUT as unset, as the service reads its own variables', { timeout: 15_000 }, async () => {
    const key = { name: 'serials', type: 'aes256-gcm96', convergent: false, latestVersion: 1, minDecryptionVersion: 1, minEncryptionVersion: 1, deletionAllowed: false, autoRotatePeriod: 0, createdAt: new Date().toISOString() };
    const url = await standIn((_req, res) => void res.writeHead(200, { 'content-type': 'application/json' }).end(JSON.stringify(key)));
    for (const blank of ['', '  ']) {
      const run = await runCli(['keys', 'show', 'serials'], { cwd: dir, env: { KEYFLEET_URL: url, KEYFLEET_TOKEN: STAND_IN_TOKEN, KEYFLEET_TIMEOUT: blank }, timeoutMs: 10_000 });
      expect(run.stderr).toBe('');
      expect(run.code).toBe(0);
      expect(JSON.parse(run.stdout)).toMatchObject({ name: 'serials' });
    }
  });
});
