import { spawn, spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { chromium, type Browser } from 'playwright-core';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { parse } from 'yaml';
import { Client } from '../helpers/client.js';
import { testEnv } from '../helpers/env.js';
import { freePort } from '../helpers/net.js';
import { startApi, startWorker, type RunningProcess } from '../helpers/processes.js';

// A batch through the real processes (API + 2 workers), then seen the way operators see it:
// Bull Board in a real browser, both workers' /metrics, and a real Prometheus query.
const BATCH_ITEMS = 60_000;
const { env, admin, encryptOnly } = testEnv({ CHUNK_ITEMS: '3000', WORKER_CONCURRENCY: '2' });
const processes: RunningProcess[] = [];
const workerPorts: number[] = [];
let client: Client;
let batchId: string;
let tmp: string;

const metricsPortOf = async (worker: RunningProcess): Promise<number> =>
  JSON.parse(await worker.waitFor(/"msg":"worker started"/)).metricsPort as number;

/** Sums the samples of one metric whose labels contain every given `label="value"` pair. */
function sumSamples(text: string, name: string, labels: string[]): number {
  return text
    .split('\n')
    .filter((l) => l.startsWith(`${name}{`) && labels.every((p) => l.includes(p)))
    .reduce((sum, l) => sum + Number(l.slice(l.lastIndexOf(' ') + 1)), 0);
}

beforeAll(async () => {
  tmp = mkdtempSync(join(tmpdir(), 'keyfleet-observability-'));
  const api = await startApi(env);
  processes.push(api);
  client = new Client(api.url, admin.token);
  for (let i = 0; i < 2; i++) {
    const worker = await startWorker(env);
    processes.push(worker);
    workerPorts.push(await metricsPortOf(worker));
  }
  await client.json('POST', '/v1/keys/observed');
  const submitted = await client.uploadNdjson('encrypt', 'observed', Array.from({ length: BATCH_ITEMS }, (_, i) => `obs-${i}`));
  batchId = submitted.body.batchId;
  expect((await client.waitForBatch(batchId)).status).toBe('completed');
});

afterAll(async () => {
  await Promise.all(processes.map((p) => p.stop()));
  rmSync(tmp, { recursive: true, force: true });
});

describe('operators see a batch', () => {
  it('in the /metrics of both workers, whose batch item counters add up to the batch', async () => {
    const texts = await Promise.all(workerPorts.map(async (p) => (await fetch(`http://127.0.0.1:${p}/metrics`)).text()));
    const perWorker = texts.map((t) => sumSamples(t, 'keyfleet_items_processed_total', ['path="batch"', 'outcome="success"', 'op="encrypt"']));
    console.log(`items per worker: ${perWorker.join(', ')}`);
    expect(perWorker.reduce((a, b) => a + b, 0)).toBe(BATCH_ITEMS);
    for (const t of texts) {
      expect(t).toContain('keyfleet_worker_pool_threads{component="worker"}');
      expect(t).not.toContain(admin.token);
      expect(t).not.toContain('observed'); // key names are never labels
    }
    const api = await (await fetch(`${client.base}/metrics`)).text();
    expect(sumSamples(api, 'keyfleet_batches_total', ['event="created"'])).toBeGreaterThanOrEqual(1);
    expect(api).toMatch(/keyfleet_http_request_duration_seconds_bucket\{[^}]*route="\/v1\/batches"/);
  });

  it('in the logs: one request id from the API upload to the worker that completes the batch, and no secret anywhere', async () => {
    const api = processes[0]!;
    const workers = processes.slice(1, 3);
    const accepted = JSON.parse(await api.waitFor(new RegExp(`"batchId":"${batchId}".*"msg":"batch accepted"`)));
    expect(accepted.reqId).toMatch(/^[0-9a-f-]{36}$/);
    const completed = workers.flatMap((w) => w.lines).filter((l) => l.includes('"msg":"batch completed"') && l.includes(batchId));
    expect(completed).toHaveLength(1);
    expect(JSON.parse(completed[0]!).requestId).toBe(accepted.reqId);
    const all = processes.flatMap((p) => p.lines).join('\n');
    for (const secret of ['obs-1', 'obs-59999', admin.token, encryptOnly.token, env['KEYFLEET_MASTER_KEY']!]) expect(all).not.toContain(secret);
  });

  it('in a real Prometheus that scrapes the API and both workers, under one job as pod annotations do', async () => {
    const promPort = await freePort();
    const config = join(tmp, 'prometheus.yml');
    const apiTarget = new URL(client.base).host;
    // One job for every target and not called keyfleet-*, like Kubernetes pod-annotation discovery
    // (deploy/k8s): what the dashboard and the alerts query must not depend on.
    const targets = [`"${apiTarget}"`, ...workerPorts.map((p) => `"127.0.0.1:${p}"`)].join(', ');
    writeFileSync(
      config,
      [
        'global: { scrape_interval: 1s, evaluation_interval: 1s }',
        'scrape_configs:',
        `  - { job_name: kubernetes-pods, static_configs: [{ targets: [${targets}] }] }`,
      ].join('\n') + '\n',
    );
    const prometheus = spawn('prometheus', [`--config.file=${config}`, `--storage.tsdb.path=${join(tmp, 'tsdb')}`, `--web.listen-address=127.0.0.1:${promPort}`], { stdio: 'ignore' });
    try {
      const query = async (promql: string): Promise<Array<{ metric: Record<string, string>; value: [number, string] }> | undefined> => {
        try {
          const res = await fetch(`http://127.0.0.1:${promPort}/api/v1/query?query=${encodeURIComponent(promql)}`);
          return ((await res.json()) as { data: { result: Array<{ metric: Record<string, string>; value: [number, string] }> } }).data.result;
        } catch {
          return undefined; // Prometheus still starting
        }
      };
      const ask = async (promql: string): Promise<number> => Number((await query(promql))?.[0]?.value[1] ?? -1);
      let value = -1;
      let up = -1;
      const deadline = Date.now() + 45_000;
      // Targets come up one scrape at a time: wait for all three and for the batch's count.
      while ((value !== BATCH_ITEMS || up !== 3) && Date.now() < deadline) {
        await new Promise((r) => setTimeout(r, 500));
        value = await ask('sum(keyfleet_items_processed_total{path="batch",op="encrypt",outcome="success"})');
        up = await ask('sum(up)');
      }
      expect(value).toBe(BATCH_ITEMS);
      expect(up).toBe(3);

      const root = resolve(import.meta.dirname, '..', '..');
      const dashboard = JSON.parse(readFileSync(resolve(root, 'dashboards/grafana/dashboards/keyfleet.json'), 'utf8')) as { panels: Array<{ title: string; targets?: Array<{ expr: string }> }> };
      const workerPanels = dashboard.panels.filter((p) => p.title === 'Workers alive');
      expect(workerPanels).toHaveLength(2);
      for (const { title, targets } of workerPanels) for (const { expr } of targets ?? []) expect(await ask(expr), `${title}: ${expr}`).toBe(2);
      // A healthy stack: every alert's expression is empty, KeyfleetApiDown's absent() included.
      const rules = (parse(readFileSync(resolve(root, 'dashboards/alerts.yml'), 'utf8')) as { groups: Array<{ rules: Array<{ alert: string; expr: string }> }> }).groups.flatMap((g) => g.rules);
      expect(rules.map((r) => r.alert)).toContain('KeyfleetApiDown');
      for (const { alert, expr } of rules) expect(await query(expr), alert).toEqual([]);
    } finally {
      const exited = new Promise((done) => prometheus.once('exit', done));
      prometheus.kill('SIGTERM');
      await exited;
    }
  });

  describe('in Bull Board, in a real browser', () => {
    let browser: Browser;
    beforeAll(async () => {
      browser = await chromium.launch({
        executablePath: '/usr/bin/chromium',
        headless: true,
        args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'],
      });
    });
    afterAll(async () => {
      await browser?.close();
    });

    it('refuses tokens without the admin scope (401 without any, 403 with another)', async () => {
      const none = await fetch(`${client.base}/admin/queues`);
      expect(none.status).toBe(401);
      expect(none.headers.get('www-authenticate')).toMatch(/^Basic /);
      const basic = (token: string) => ({ authorization: `Basic ${Buffer.from(`ops:${token}`).toString('base64')}` });
      expect((await fetch(`${client.base}/admin/queues`, { headers: basic(encryptOnly.token) })).status).toBe(403);
      const ok = await fetch(`${client.base}/admin/queues`, { headers: basic(admin.token) });
      expect(ok.status).toBe(200);
      expect(ok.headers.get('content-security-policy')).toContain("frame-ancestors 'none'");
      expect(ok.headers.get('x-content-type-options')).toBe('nosniff');
    });

    it('signs in with HTTP Basic and shows the chunk queue with a completed job of the batch, and the webhook queue, offering no action', async () => {
      const context = await browser.newContext({ httpCredentials: { username: 'ops', password: admin.token }, viewport: { width: 1400, height: 900 } });
      const page = await context.newPage();
      await page.goto(`${client.base}/admin/queues`);
      await page.getByText('chunks', { exact: false }).first().waitFor({ timeout: 20_000 });
      await page.getByText('webhooks', { exact: false }).first().waitFor({ timeout: 20_000 });
      await page.goto(`${client.base}/admin/queues/queue/chunks?status=completed`);
      // Newest first, ten to a page: any chunk of the batch will do.
      await page.getByText(`${batchId}.`, { exact: false }).first().waitFor({ timeout: 20_000 });
      const shots = process.env['UPDATE_SCREENSHOTS'] ? resolve(import.meta.dirname, '..', '..', 'docs') : tmp;
      mkdirSync(shots, { recursive: true });
      await page.screenshot({ path: join(shots, 'bull-board.png') });
      expect(await page.content()).not.toContain(admin.token);
      // Read-only by default (BULL_BOARD_ACTIONS): the board offers none of its actions.
      expect(await page.getByRole('button', { name: /clean|retry|promote|pause|empty|obliterate|add job|duplicate|remove/i }).count()).toBe(0);
      await context.close();
    });
  });
});

// Fail loudly, not silently, where the machine lacks the tools (CI installs them: .ci/run).
for (const [tool, args] of [['prometheus', ['--version']], ['/usr/bin/chromium', ['--version']]] as const) {
  if (spawnSync(tool, [...args]).status !== 0) throw new Error(`${tool} is required by this test (apt-get install prometheus chromium)`);
}
