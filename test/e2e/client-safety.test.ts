import { createServer } from 'node:http';
import { connect, createServer as createTcpServer, type Socket } from 'node:net';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { execFileSync } from 'node:child_process';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { KeyfleetClient } from '../../client/index.js';
import { STAND_IN_TOKEN, testEnv } from '../helpers/env.js';
import { runCli } from '../helpers/cli.js';
import { tcpProxy, type ProxiedConnection } from '../helpers/net.js';
import { type ApiProcess, startApiAndWorker, type RunningProcess } from '../helpers/processes.js';

// What the client and the CLI must never do: work done twice, output lost without a word,
// secrets printed, input lines dropped. Each against the real service.
const { env, admin } = testEnv({ KEY_CACHE_TTL_MS: '0' });
let api: ApiProcess;
let worker: RunningProcess;
let port: number;
let url: string;
let dir: string;

beforeAll(async () => {
  [api, worker] = await startApiAndWorker(env);
  ({ port, url } = api);
  dir = mkdtempSync(join(tmpdir(), 'keyfleet-client-'));
});
afterAll(async () => {
  await Promise.all([worker?.stop(), api?.stop()]);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

/** The built CLI as the admin tenant against this file's API. */
const keyfleet = (args: string[], extraEnv: Record<string, string> = {}) => runCli(args, { cwd: dir, env: { KEYFLEET_URL: url, KEYFLEET_TOKEN: admin.token, ...extraEnv }, timeoutMs: 60_000 });

const path = (name: string) => join(dir, name);

/** The batches the API has created so far (its metrics: the API has no list of them). */
async function batchesCreated(): Promise<number> {
  const text = await (await fetch(`${url}/metrics`)).text();
  return Number(/^keyfleet_batches_total\{[^}]*event="created"[^}]*\} (\d+)$/m.exec(text)![1]);
}

/**
 * A gateway in front of the API that, for the first request matching each pattern, lets the API
 * do the work and answers the client 503 instead of the API's answer.
 */
async function losingGateway(patterns: RegExp[]) {
  const left = [...patterns];
  const requests = new WeakMap<ProxiedConnection['client'], string>();
  const swallowing = new WeakSet<ProxiedConnection['client']>();
  return tcpProxy('127.0.0.1', port, {
    fromClient(data, { client, upstream }) {
      const line = /^([A-Z]+ \S+) HTTP\/1\.1\r\n/.exec(data.toString('latin1'));
      if (line) requests.set(client, line[1]!);
      upstream.write(data);
    },
    fromUpstream(data, { client, upstream }) {
      if (swallowing.has(client)) return;
      const request = requests.get(client) ?? '';
      const at = left.findIndex((p) => p.test(request));
      if (at === -1 || !/^HTTP\/1\.1 20\d /.test(data.toString('latin1'))) {
        client.write(data);
        return;
      }
      left.splice(at, 1);
      swallowing.add(client);
      upstream.destroy();
      client.end('HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 19\r\nconnection: close\r\n\r\nService Unavailable');
    },
  });
}

/**
 * A gateway that gives up on the first upload at once: it answers the client 503 as soon as the
 * whole upload has arrived, and passes it on to the API with its last bytes (the end of its
 * chunked body) 1.5 s late, so that the API is still running it when the client's retry comes.
 * Everything else passes through; `statuses` are the API's answers the client got.
 */
async function impatientGateway() {
  const sockets = new Set<Socket>();
  const timers = new Set<NodeJS.Timeout>();
  const statuses: number[] = [];
  const uploads: number[] = []; // when each upload attempt reached the gateway
  let heldOne = false;
  const server = createTcpServer((client) => {
    const upstream = connect(port, '127.0.0.1');
    for (const socket of [client, upstream]) sockets.add(socket.once('close', () => sockets.delete(socket)));
    let holding: boolean | undefined;
    let held = Buffer.alloc(0);
    client.on('data', (data: Buffer) => {
      if (/^POST \/v1\/batches\?/.test(data.toString('latin1'))) uploads.push(Date.now());
      holding ??= !heldOne && uploads.length === 1;
      if (!holding) return void upstream.write(data);
      heldOne = true;
      held = Buffer.concat([held, data]);
      if (!held.subarray(-5).equals(Buffer.from('0\r\n\r\n'))) return;
      upstream.write(held.subarray(0, -5));
      client.end('HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n');
      const timer = setTimeout(() => upstream.write('0\r\n\r\n'), 1_500);
      timers.add(timer);
    });
    upstream.on('data', (data: Buffer) => {
      if (holding) return; // the first upload's answer is lost
      const answer = /^HTTP\/1\.1 (\d{3}) /.exec(data.toString('latin1'));
      if (answer) statuses.push(Number(answer[1]));
      client.write(data);
    });
    // The held upload stays open to the API after the client has gone.
    client.on('end', () => holding || upstream.end());
    client.on('error', () => holding || upstream.destroy());
    upstream.on('end', () => client.end());
    upstream.on('error', () => client.destroy());
  });
  await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
  return {
    port: (server.address() as { port: number }).port,
    statuses,
    uploads,
    close: async () => {
      for (const timer of timers) clearTimeout(timer);
      for (const socket of sockets) socket.destroy();
      await new Promise((ok) => server.close(ok));
    },
  };
}

describe('the client and the CLI', () => {
  it('make one batch and one rotation when a gateway loses the API’s answer and says 503', async () => {
    const client = new KeyfleetClient({ url, token: admin.token });
    await client.createKey('gateway');
    const gateway = await losingGateway([/^POST \/v1\/batches\?/, /^POST \/v1\/encrypt\//, /^POST \/v1\/keys\/gateway\/rotate$/]);
    try {
      const through = { KEYFLEET_URL: `http://127.0.0.1:${gateway.port}` };
      writeFileSync(path('three.txt'), 'a\nb\nc\n');
      let before = await batchesCreated();
      const upload = await keyfleet(['encrypt', '--key', 'gateway', '--in', 'three.txt', '--out', 'three.enc'], through);
      expect(upload.stderr).not.toContain('keyfleet: KF_');
      expect(upload.code).toBe(0);
      expect(readFileSync(path('three.enc'), 'utf8').split('\n')).toHaveLength(4);
      expect(await batchesCreated()).toBe(before + 1);

      // A crypto call that may become a batch, through the SDK.
      before = await batchesCreated();
      const viaGateway = new KeyfleetClient({ url: through.KEYFLEET_URL, token: admin.token, retry: { baseDelayMs: 10 } });
      const answer = await viaGateway.encrypt('gateway', ['x', 'y'], { mode: 'async' });
      expect(answer.kind).toBe('batch');
      expect(await batchesCreated()).toBe(before + 1);

      const { latestVersion } = await client.getKey('gateway');
      const rotate = await keyfleet(['keys', 'rotate', 'gateway'], through);
      // The client cannot know whether the API rotated: it says so rather than rotating again.
      expect(rotate.code).toBe(1);
      expect(rotate.stderr).toContain('503');
      expect((await client.getKey('gateway')).latestVersion).toBe(latestVersion + 1);
    } finally {
      await gateway.close();
    }
  });

  it('waits for a keyed upload still running when its retry comes (409 KF_IDEMPOTENCY_IN_PROGRESS), then gets its one batch', async () => {
    const client = new KeyfleetClient({ url, token: admin.token });
    await client.createKey('patient');
    const gateway = await impatientGateway();
    try {
      const before = await batchesCreated();
      const viaGateway = new KeyfleetClient({ url: `http://127.0.0.1:${gateway.port}`, token: admin.token, retry: { baseDelayMs: 10 } });
      const accepted = await viaGateway.createBatch({ op: 'encrypt', key: 'patient' }, () => ['a', 'b', 'c']);
      // The retry found the first attempt running, waited as asked (Retry-After: 1), and got its answer.
      expect(gateway.statuses[0]).toBe(409);
      expect(gateway.statuses.at(-1)).toBe(202);
      expect(gateway.uploads[2]! - gateway.uploads[1]!).toBeGreaterThanOrEqual(950);
      expect(await batchesCreated()).toBe(before + 1);
      expect(await client.waitForBatch(accepted.batchId)).toMatchObject({ status: 'completed', total: 3 });
    } finally {
      await gateway.close();
    }
  });

  it('says a key was created when a gateway lost the API’s 201 and the retry found the key', async () => {
    const gateway = await losingGateway([/^POST \/v1\/keys\/lost-201$/, /^POST \/v1\/keys\/lost-cli$/]);
    try {
      const through = `http://127.0.0.1:${gateway.port}`;
      const viaGateway = new KeyfleetClient({ url: through, token: admin.token, retry: { baseDelayMs: 10 } });
      expect(await viaGateway.createKey('lost-201')).toMatchObject({ name: 'lost-201', latestVersion: 1, created: true });
      const run = await keyfleet(['keys', 'create', 'lost-cli'], { KEYFLEET_URL: through });
      expect(run.code, run.stderr).toBe(0);
      expect(run.stderr).toBe('keyfleet: key lost-cli created\n');
      // A key that was there before is found, not created, through the same gateway.
      expect((await viaGateway.createKey('lost-201')).created).toBe(false);
    } finally {
      await gateway.close();
    }
  });

  it('stops at a full disk naming the output file and ENOSPC, exit 1, without retrying the download', async () => {
    const client = new KeyfleetClient({ url, token: admin.token });
    await client.createKey('full');
    writeFileSync(path('many.txt'), Array.from({ length: 20_000 }, (_, n) => `serial-${n}`).join('\n') + '\n');
    const run = await keyfleet(['encrypt', '--key', 'full', '--in', 'many.txt', '--out', '/dev/full']);
    expect(run.code).toBe(1);
    expect(run.stderr).toMatch(/keyfleet: cannot write the results to \/dev\/full \(ENOSPC\); once it can be written, resume with --resume [\w-]+\n$/);
    expect(run.stderr).not.toContain('download interrupted');
  });

  it('never prints a token it cannot send, nor a password in the URL', async () => {
    const badToken = await keyfleet(['keys', 'show', 'serials'], { KEYFLEET_TOKEN: 'SECRET123\nx' });
    expect(badToken.code).toBe(1);
    expect(badToken.stderr).toContain('keyfleet: ');
    expect(badToken.stdout + badToken.stderr).not.toContain('SECRET123');

    const withPassword = await keyfleet(['keys', 'show', 'serials'], { KEYFLEET_URL: `http://user:s3cr3t@127.0.0.1:${port}` });
    expect(withPassword.code).toBe(1);
    expect(withPassword.stderr).toContain('keyfleet: ');
    expect(withPassword.stdout + withPassword.stderr).not.toContain('s3cr3t');

    // The SDK refuses both in its constructor, with messages that name the option, not its value.
    expect(() => new KeyfleetClient({ url, token: 'SECRET123 x' })).toThrow(/^keyfleet client: the token .*visible ASCII/);
    // Shorter than any token the service takes (KEYFLEET_TOKENS refuses one under 16 characters): refused with the service's bounds.
    expect(() => new KeyfleetClient({ url, token: 'SECRET123-short' })).toThrow(/^keyfleet client: the token must be 16-512 visible ASCII characters/);
    expect(() => new KeyfleetClient({ url: `http://user:s3cr3t@127.0.0.1:${port}`, token: admin.token })).toThrow(/^keyfleet client: the URL holds credentials/);
    for (const bad of [() => new KeyfleetClient({ url, token: 'SECRET123 x' }), () => new KeyfleetClient({ url, token: 'SECRET123-short' }), () => new KeyfleetClient({ url: `http://user:s3cr3t@127.0.0.1:${port}`, token: admin.token })]) {
      expect(() => bad()).not.toThrow(/SECRET123|s3cr3t/);
    }
  });

  it('leaves an app’s own zod messages as they were when it imports the client (the API’s wording is set in the API alone)', () => {
    const script = `import('${resolve(import.meta.dirname, '..', '..', 'dist', 'client', 'index.js')}').then(async () => {
      const { z } = await import('zod');
      console.log(z.object({ name: z.string() }).safeParse({}).error.issues[0].message);
    })`;
    expect(execFileSync(process.execPath, ['-e', script], { cwd: resolve(import.meta.dirname, '..', '..'), encoding: 'utf8' }).trim()).toBe('Invalid input: expected string, received undefined');
  });

  it('sends every NDJSON line the API does not take as blank, so failures keep their line numbers', async () => {
    const client = new KeyfleetClient({ url, token: admin.token });
    await client.createKey('lines');
    // A no-break space and an ideographic space are not blank to the API (KF_INVALID_ITEM);
    // spaces, tabs and a trailing CR are, and make no item.
    writeFileSync(path('spaced.ndjson'), '"a"\n\u00a0\n"b"\n \t\r\n\u3000\n"c"\n');
    const run = await keyfleet(['encrypt', '--key', 'lines', '--ndjson', '--in', 'spaced.ndjson', '--out', 'spaced.out']);
    expect(run.code).toBe(2);
    expect(run.stderr).toMatch(/^line 2: KF_INVALID_ITEM /m);
    expect(run.stderr).toMatch(/^line 5: KF_INVALID_ITEM /m);
    // One output line per input line: the blank one stays blank.
    const out = readFileSync(path('spaced.out'), 'utf8').split('\n');
    expect(out).toHaveLength(7);
    expect(out.slice(0, 6).map((l) => (l === 'null' ? null : l === '' ? '' : typeof JSON.parse(l)))).toEqual(['string', null, 'string', '', null, 'string']);
    expect(out[6]).toBe('');
  });

  it('says it cannot write batch results to a path in a missing folder, and exits 1 without a stack', async () => {
    const client = new KeyfleetClient({ url, token: admin.token });
    await client.createKey('results');
    const { batchId } = await client.createBatch({ op: 'encrypt', key: 'results' }, () => ['a', 'b']);
    await client.waitForBatch(batchId);
    const run = await keyfleet(['batch', 'results', batchId, '--out', '/nonexistent/x']);
    expect(run.code).toBe(1);
    expect(run.stderr).toBe('keyfleet: cannot write /nonexistent/x (ENOENT)\n');
    expect(run.stdout).toBe('');
  });

  it('says a batch expired or was deleted when its record goes while the CLI waits', async () => {
    // A stand-in API whose event stream says what producer/sse.ts says of a record that is gone.
    const status = JSON.stringify({ id: 'Gone1234Gone5678', op: 'encrypt', key: 'k', status: 'running', total: 10, processed: 3, succeeded: 3, failed: 0, createdAt: new Date().toISOString() });
    const server = createServer((req, res) => {
      // The status read first (a --resume checks the batch's op and key), while it still runs.
      if (!req.url?.endsWith('/events')) return void res.writeHead(200, { 'content-type': 'application/json' }).end(status);
      res.writeHead(200, { 'content-type': 'text/event-stream' });
      res.end(`event: progress\ndata: ${status}\n\nevent: done\ndata: ${JSON.stringify({ id: 'Gone1234Gone5678', status: 'deleted' })}\n\n`);
    });
    await new Promise<void>((ok) => server.listen(0, '127.0.0.1', ok));
    try {
      const standIn = `http://127.0.0.1:${(server.address() as { port: number }).port}`;
      const client = new KeyfleetClient({ url: standIn, token: STAND_IN_TOKEN });
      await expect(client.waitForBatch('Gone1234Gone5678')).rejects.toThrow(/^batch Gone1234Gone5678 expired or was deleted$/);
      const run = await keyfleet(['encrypt', '--key', 'k', '--resume', 'Gone1234Gone5678', '--out', 'gone.enc'], { KEYFLEET_URL: standIn });
      expect(run.code).toBe(1);
      expect(run.stderr).toMatch(/\nkeyfleet: batch Gone1234Gone5678 expired or was deleted\n$/);
    } finally {
      server.closeAllConnections();
      await new Promise((ok) => server.close(ok));
    }
  });
});
