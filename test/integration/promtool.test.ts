import { spawnSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import type { FastifyInstance } from 'fastify';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { parse, stringify } from 'yaml';
import { buildApp } from '../../producer/app.js';
import { Client } from '../helpers/client.js';
import { configFrom, testEnv } from '../helpers/env.js';
import { startWorker, type RunningProcess } from '../helpers/processes.js';

// The monitoring files checked by the tool Prometheus ships (promtool) and against the metrics
// the API and a worker really export: the scrape config and alert rules are valid, the alerts
// fire (and stay quiet) in the situations they are written for, the live /metrics pass
// `promtool check metrics`, and every metric the dashboard and the alerts query exists.

const root = resolve(import.meta.dirname, '..', '..');
const hasPromtool = spawnSync('promtool', ['--version']).status === 0;

type Doc = Record<string, any>;

interface Run {
  readonly status: number | null;
  readonly output: string;
}

const promtool = (args: string[], input?: string): Run => {
  const r = spawnSync('promtool', args, { encoding: 'utf8', ...(input === undefined ? {} : { input }), timeout: 60_000 });
  return { status: r.status, output: `${r.stdout ?? ''}${r.stderr ?? ''}` };
};

const alertsFile = resolve(root, 'dashboards/alerts.yml');
const alertRules = (): Doc[] => (parse(readFileSync(alertsFile, 'utf8')) as Doc)['groups'].flatMap((g: Doc) => g['rules'] as Doc[]);

const dashboardFile = resolve(root, 'dashboards/grafana/dashboards/keyfleet.json');
/** The dashboard's panels, those inside rows included. */
const dashboardPanels = (): Doc[] => ((JSON.parse(readFileSync(dashboardFile, 'utf8')) as Doc)['panels'] as Doc[]).flatMap((p) => [p, ...((p['panels'] as Doc[] | undefined) ?? [])]);

const PROMQL_KEYWORDS = new Set(['by', 'without', 'on', 'ignoring', 'group_left', 'group_right', 'and', 'or', 'unless', 'bool', 'offset', 'inf', 'nan']);

/**
 * The metric names a PromQL expression selects: identifiers that are not functions, keywords,
 * label names (inside {…} or by/on/… (…)) or durations, with strings and Grafana variables removed.
 */
function metricNamesIn(expr: string): string[] {
  const bare = expr
    .replace(/"(?:[^"\\]|\\.)*"/g, '""')
    .replace(/\{[^}]*\}/g, ' ')
    .replace(/\[[^\]]*\]/g, ' ')
    .replace(/\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)/g, ' ');
  const names = new Set<string>();
  for (const m of bare.matchAll(/[A-Za-z_:][A-Za-z0-9_:]*/g)) {
    const before = bare[m.index - 1] ?? ' ';
    const after = bare.slice(m.index + m[0].length);
    if (/[0-9.$]/.test(before) || /^\s*\(/.test(after) || PROMQL_KEYWORDS.has(m[0].toLowerCase())) continue;
    names.add(m[0]);
  }
  return [...names];
}

/** Sample names (not families) in a Prometheus text exposition: what a query can select. */
const sampleNames = (text: string): Set<string> =>
  new Set(
    text
      .split('\n')
      .filter((l) => l && !l.startsWith('#'))
      .map((l) => /^[A-Za-z_:][A-Za-z0-9_:]*/.exec(l)?.[0] ?? ''),
  );

describe.runIf(hasPromtool)('the Prometheus config and alert rules, checked by promtool', () => {
  let tmp: string;
  beforeAll(() => {
    tmp = mkdtempSync(join(tmpdir(), 'keyfleet-promtool-'));
  });
  afterAll(() => {
    rmSync(tmp, { recursive: true, force: true });
  });

  it('accepts dashboards/prometheus.yml with its rule file', () => {
    const config = parse(readFileSync(resolve(root, 'dashboards/prometheus.yml'), 'utf8')) as Doc;
    // rule_files names the path inside the compose container; check the repository's file instead.
    expect(config['rule_files']).toEqual(['/etc/prometheus/alerts.yml']);
    config['rule_files'] = [alertsFile];
    const copy = join(tmp, 'prometheus.yml');
    writeFileSync(copy, stringify(config));
    const run = promtool(['check', 'config', copy]);
    expect(run.status, run.output).toBe(0);
    expect(run.output).toContain('SUCCESS: 1 rule files found');
    const jobs = (config['scrape_configs'] as Doc[]).map((j) => j['job_name']);
    expect(jobs).toEqual(['keyfleet-api', 'keyfleet-worker']);
    expect(config['scrape_configs'][1].dns_sd_configs).toEqual([expect.objectContaining({ names: ['worker'], type: 'A', port: 9464 })]);
  });

  it('accepts dashboards/alerts.yml, which defines the seven keyfleet alerts with summaries and descriptions', () => {
    const run = promtool(['check', 'rules', alertsFile]);
    expect(run.status, run.output).toBe(0);
    const rules = alertRules();
    expect(rules.map((r) => r['alert']).sort()).toEqual(['KeyfleetApiDown', 'KeyfleetBacklogGrowing', 'KeyfleetChunksFailing', 'KeyfleetHighErrorRate', 'KeyfleetNoWorkerAlive', 'KeyfleetNonceBudgetNearlySpent', 'KeyfleetRedisUnreachable']);
    for (const r of rules) {
      expect(r['annotations']?.summary, r['alert']).toBeTruthy();
      expect(r['annotations']?.description, r['alert']).toMatch(/Runbook:/);
      expect(r['labels']?.severity, r['alert']).toMatch(/^(warning|critical)$/);
    }
  });

  it('fires each alert in the situation it is written for, and stays quiet in the healthy neighbour', () => {
    const api = 'component="api",instance="api:8080",job="keyfleet-api"';
    const worker = 'component="worker",instance="10.0.0.5:9464",job="keyfleet-worker"';
    // Kubernetes pod-annotation discovery (deploy/k8s): one job for every pod, not named after keyfleet.
    const pod = (ip: string) => `instance="${ip}",job="kubernetes-pods"`;
    const firing = (alertname: string, evalTime: string, expected: number) => ({
      expr: `count(ALERTS{alertname="${alertname}",alertstate="firing"}) or vector(0)`,
      eval_time: evalTime,
      exp_samples: [{ labels: '{}', value: expected }],
    });
    const test = (name: string, series: Record<string, string>, expectations: Array<ReturnType<typeof firing>>) => ({
      name,
      interval: '1m',
      input_series: Object.entries(series).map(([s, values]) => ({ series: s, values })),
      promql_expr_test: expectations,
    });
    const suite = {
      rule_files: [alertsFile],
      evaluation_interval: '1m',
      tests: [
        test('no worker process scraped while Redis still lists a ghost connection', {
          [`keyfleet_queue_backlog_items{${api}}`]: '5000x10',
          [`keyfleet_queue_workers{${api}}`]: '2x10',
          [`keyfleet_redis_up{${api}}`]: '1x10',
        }, [firing('KeyfleetNoWorkerAlive', '1m', 0), firing('KeyfleetNoWorkerAlive', '4m', 1)]),
        test('no worker at all: both signals hold, and one alert fires, not two', {
          [`keyfleet_queue_backlog_items{${api}}`]: '5000x10',
          [`keyfleet_queue_workers{${api}}`]: '0x10',
          [`keyfleet_redis_up{${api}}`]: '1x10',
        }, [firing('KeyfleetNoWorkerAlive', '1m', 0), firing('KeyfleetNoWorkerAlive', '4m', 1)]),
        test('workers scraped but none connected to the queue', {
          [`keyfleet_queue_backlog_items{${api}}`]: '5000x10',
          [`keyfleet_queue_workers{${api}}`]: '0x10',
          [`keyfleet_redis_up{${api}}`]: '1x10',
          [`keyfleet_worker_pool_threads{${worker}}`]: '2x10',
        }, [firing('KeyfleetNoWorkerAlive', '4m', 1)]),
        test('a healthy worker with a backlog, and no backlog without workers', {
          [`keyfleet_queue_backlog_items{${api}}`]: '5000x5 0x10',
          [`keyfleet_queue_workers{${api}}`]: '1x5 0x10',
          [`keyfleet_redis_up{${api}}`]: '1x15',
          [`keyfleet_worker_pool_threads{${worker}}`]: '2x5 _x10',
        }, [firing('KeyfleetNoWorkerAlive', '5m', 0), firing('KeyfleetNoWorkerAlive', '15m', 0)]),
        test('Redis down: the frozen worker gauge does not page as "no worker", Redis does', {
          [`keyfleet_queue_backlog_items{${api}}`]: '5000x10',
          [`keyfleet_queue_workers{${api}}`]: '0x10',
          [`keyfleet_redis_up{${api}}`]: '0x10',
          [`keyfleet_worker_pool_threads{${worker}}`]: '2x10',
        }, [firing('KeyfleetNoWorkerAlive', '5m', 0), firing('KeyfleetRedisUnreachable', '5m', 1), firing('KeyfleetRedisUnreachable', '0m', 0)]),
        test('a backlog growing for 20 minutes, against one flat and one draining', {
          [`keyfleet_queue_backlog_items{${api}}`]: '0+1000x40',
        }, [firing('KeyfleetBacklogGrowing', '25m', 1), firing('KeyfleetBacklogGrowing', '5m', 0)]),
        test('a flat backlog does not grow', {
          [`keyfleet_queue_backlog_items{${api}}`]: '5000x40',
        }, [firing('KeyfleetBacklogGrowing', '30m', 0)]),
        test('a draining backlog does not grow', {
          [`keyfleet_queue_backlog_items{${api}}`]: '40000-1000x40',
        }, [firing('KeyfleetBacklogGrowing', '30m', 0)]),
        test('a key version past 90% of its nonce budget, and one rotated at half of it', {
          [`keyfleet_nonce_budget_max_used_ratio{${api}}`]: '0.5+0.05x10 1x10',
          [`keyfleet_nonce_budget_max_used_ratio{${worker}}`]: '0.5x20',
        }, [firing('KeyfleetNonceBudgetNearlySpent', '8m', 0), firing('KeyfleetNonceBudgetNearlySpent', '15m', 1)]),
        test('one item in six failing', {
          [`keyfleet_items_processed_total{${worker},op="decrypt",key_type="aes256-gcm",path="batch",outcome="success"}`]: '0+600x20',
          [`keyfleet_items_processed_total{${worker},op="decrypt",key_type="aes256-gcm",path="batch",outcome="failure"}`]: '0+120x20',
        }, [firing('KeyfleetHighErrorRate', '15m', 1)]),
        test('one item in a hundred failing', {
          [`keyfleet_items_processed_total{${worker},op="decrypt",key_type="aes256-gcm",path="batch",outcome="success"}`]: '0+600x20',
          [`keyfleet_items_processed_total{${worker},op="decrypt",key_type="aes256-gcm",path="batch",outcome="failure"}`]: '0+6x20',
        }, [firing('KeyfleetHighErrorRate', '15m', 0)]),
        test('one request in eleven answered 500', {
          [`keyfleet_http_request_duration_seconds_count{${api},method="POST",route="/v1/encrypt/:key",status_code="200"}`]: '0+600x20',
          [`keyfleet_http_request_duration_seconds_count{${api},method="POST",route="/v1/encrypt/:key",status_code="500"}`]: '0+60x20',
        }, [firing('KeyfleetHighErrorRate', '15m', 1)]),
        test('only readiness probes failing (Redis down) is not an HTTP error rate', {
          [`keyfleet_http_request_duration_seconds_count{${api},method="GET",route="/readyz",status_code="503"}`]: '0+60x20',
        }, [firing('KeyfleetHighErrorRate', '15m', 0)]),
        test('the API target down for 3 minutes: one alert, though no API reports either', {
          'up{instance="api:8080",job="keyfleet-api"}': '1 0x5',
          [`keyfleet_redis_up{${api}}`]: '1 stale',
        }, [firing('KeyfleetApiDown', '1m', 0), firing('KeyfleetApiDown', '4m', 1)]),
        test('one of two API pods failing its scrape, under a job not called keyfleet-api', {
          [`up{${pod('10.1.0.7:8080')}}`]: '1x10',
          [`keyfleet_redis_up{component="api",${pod('10.1.0.7:8080')}}`]: '1x10',
          [`up{${pod('10.1.0.8:8080')}}`]: '1x2 0x8',
          [`keyfleet_redis_up{component="api",${pod('10.1.0.8:8080')}}`]: '1x2 stale',
        }, [firing('KeyfleetApiDown', '2m', 0), firing('KeyfleetApiDown', '5m', 1)]),
        test('every API pod gone: no target, no up, no API metric at all', {
          [`up{${pod('10.1.0.9:9464')}}`]: '1x10',
          [`keyfleet_worker_pool_threads{component="worker",${pod('10.1.0.9:9464')}}`]: '2x10',
          [`keyfleet_redis_up{component="api",${pod('10.1.0.7:8080')}}`]: '1x2 stale',
        }, [firing('KeyfleetApiDown', '2m', 0), firing('KeyfleetApiDown', '5m', 1)]),
        test('healthy API pods, and a worker pod failing its scrape, are no API down', {
          [`up{${pod('10.1.0.7:8080')}}`]: '1x10',
          [`keyfleet_redis_up{component="api",${pod('10.1.0.7:8080')}}`]: '1x10',
          [`up{${pod('10.1.0.9:9464')}}`]: '1x2 0x8',
          [`keyfleet_worker_pool_threads{component="worker",${pod('10.1.0.9:9464')}}`]: '2x2 stale',
        }, [firing('KeyfleetApiDown', '10m', 0)]),
        // A worker with another (valid) KEYFLEET_MASTER_KEY fails every chunk it takes. The
        // counters start at 0, as every process exports them from its start.
        test('a worker failing every chunk it takes, in a busy fleet whose retries save the batches', {
          [`keyfleet_chunks_total{${worker},outcome="failed"}`]: '0+10x30',
          [`keyfleet_chunks_total{${worker},outcome="counted"}`]: '0+50x30',
          [`keyfleet_batches_total{${worker},event="failed"}`]: '0x30',
        }, [firing('KeyfleetChunksFailing', '5m', 0), firing('KeyfleetChunksFailing', '15m', 1)]),
        test('one batch on an idle fleet: its chunk fails 5 quick attempts and the batch fails', {
          [`keyfleet_chunks_total{${worker},outcome="failed"}`]: '0 5x45',
          [`keyfleet_batches_total{${worker},event="failed"}`]: '0 1x45',
        }, [firing('KeyfleetChunksFailing', '5m', 0), firing('KeyfleetChunksFailing', '15m', 1), firing('KeyfleetChunksFailing', '40m', 0)]),
        test('a burst of failed attempts that their retries finish (a Redis blip) is no alert', {
          [`keyfleet_chunks_total{${worker},outcome="failed"}`]: '0x5 40x30',
          [`keyfleet_chunks_total{${worker},outcome="counted"}`]: '0+50x35',
          [`keyfleet_batches_total{${worker},event="failed"}`]: '0x35',
        }, [firing('KeyfleetChunksFailing', '8m', 0), firing('KeyfleetChunksFailing', '12m', 0), firing('KeyfleetChunksFailing', '20m', 0)]),
        test('uploads the API refuses or loses (failed batches it counts) are the callers\' doing, no alert', {
          [`keyfleet_batches_total{${api},event="failed"}`]: '0+1x40',
          [`keyfleet_chunks_total{${worker},outcome="failed"}`]: '0x40',
          [`keyfleet_batches_total{${worker},event="failed"}`]: '0x40',
        }, [firing('KeyfleetChunksFailing', '20m', 0)]),
      ],
    };
    const file = join(tmp, 'alerts.test.yml');
    writeFileSync(file, stringify(suite));
    const run = promtool(['test', 'rules', file]);
    expect(run.status, run.output).toBe(0);
    expect(run.output).toContain('SUCCESS');
  });

  it('shows on the dashboard which status codes the API answered 4xx and 5xx with (where KeyfleetHighErrorRate sends you), and 0 when it answered none', () => {
    expect(alertRules().find((r) => r['alert'] === 'KeyfleetHighErrorRate')?.annotations?.description).toMatch(/panel "Errors": which op and which status codes/);
    const panel = dashboardPanels().find((p) => p['title'] === 'HTTP 4xx / 5xx per second');
    expect(panel, 'the HTTP error panel').toBeDefined();
    const targets = panel!['targets'] as Doc[];
    expect(targets.map((t) => t['legendFormat'])).toEqual(['{{status_code}}']);
    // A range query with no series at all (no 4xx or 5xx since the API started) shows this instead of "No data".
    expect(panel!['fieldConfig']?.defaults?.noValue).toBe('0');

    const api = 'component="api",instance="api:8080",job="keyfleet-api"';
    const requests = (route: string, status: number) => `keyfleet_http_request_duration_seconds_count{${api},method="POST",route="${route}",status_code="${status}"}`;
    const expr = (targets[0]!['expr'] as string).replaceAll('$__rate_interval', '5m');
    const suite = {
      rule_files: [],
      evaluation_interval: '1m',
      tests: [
        {
          interval: '1m',
          input_series: [
            { series: requests('/v1/encrypt/:key', 200), values: '0+600x20' },
            { series: requests('/v1/encrypt/:key', 404), values: '0+60x20' },
            { series: requests('/v1/encrypt/:key', 429), values: '0+30x20' },
            { series: requests('/v1/batches', 429), values: '0+30x20' },
            { series: requests('/v1/batches', 503), values: '0+6x20' },
          ],
          // Per second, summed over routes, and no 2xx.
          promql_expr_test: [{ expr, eval_time: '10m', exp_samples: [{ labels: '{status_code="404"}', value: 1 }, { labels: '{status_code="429"}', value: 1 }, { labels: '{status_code="503"}', value: 0.1 }] }],
        },
        {
          interval: '1m',
          input_series: [{ series: requests('/v1/encrypt/:key', 200), values: '0+600x20' }],
          promql_expr_test: [{ expr, eval_time: '10m', exp_samples: [] }],
        },
      ],
    };
    const file = join(tmp, 'dashboard.test.yml');
    writeFileSync(file, stringify(suite));
    const run = promtool(['test', 'rules', file]);
    expect(run.status, run.output).toBe(0);
    expect(run.output).toContain('SUCCESS');
  });
});

describe.runIf(hasPromtool)('the live /metrics of an API and a worker', () => {
  const { env, admin } = testEnv({ CHUNK_ITEMS: '4', SYNC_MAX_ITEMS: '10' });
  let app: FastifyInstance | undefined;
  let worker: RunningProcess | undefined;
  let apiMetrics = '';
  let workerMetrics = '';

  beforeAll(async () => {
    app = await buildApp({ config: configFrom(env) });
    const address = await app.listen({ host: '127.0.0.1', port: 0 });
    const client = new Client(address, admin.token);
    worker = await startWorker(env);
    const metricsPort = (JSON.parse(await worker.waitFor(/"msg":"worker started"/)) as { metricsPort: number }).metricsPort;

    // Enough traffic that every series the dashboard and alerts use exists: a key, sync requests
    // (one with a failing item), and a batch of several chunks run by the worker.
    expect((await client.json('POST', '/v1/keys/observed')).status).toBe(201);
    expect((await client.json('POST', '/v1/encrypt/observed', { items: ['a', 'b'] })).status).toBe(200);
    expect((await client.json('POST', '/v1/decrypt/observed', { items: ['kf:v1:not-a-ciphertext'] })).status).toBe(200);
    const submitted = await client.uploadNdjson('encrypt', 'observed', Array.from({ length: 10 }, (_, i) => `item-${i}`));
    expect(submitted.status).toBe(202);
    expect(await client.waitForBatch(submitted.body.batchId)).toMatchObject({ status: 'completed', succeeded: 10 });

    apiMetrics = await (await fetch(`${address}/metrics`)).text();
    workerMetrics = await (await fetch(`http://127.0.0.1:${metricsPort}/metrics`)).text();
  });

  afterAll(async () => {
    await worker?.stop();
    await app?.close();
  });

  const checkMetrics = (text: string): Run => {
    const run = promtool(['check', 'metrics'], text);
    if (run.output.trim()) console.log(`promtool check metrics:\n${run.output}`);
    return run;
  };

  it('passes promtool check metrics for the API', () => {
    expect(apiMetrics).toMatch(/^keyfleet_queue_backlog_items\{component="api"\} \d+$/m);
    expect(apiMetrics).toMatch(/^keyfleet_http_request_duration_seconds_bucket\{/m);
    const run = checkMetrics(apiMetrics);
    expect(run.status, run.output).toBe(0);
    expect(run.output.split('\n').filter((l) => /error/i.test(l))).toEqual([]);
  });

  it('passes promtool check metrics for the worker, whose batch items are counted on path="batch"', () => {
    expect(workerMetrics).toMatch(/^keyfleet_items_processed_total\{[^}]*path="batch"[^}]*\} 10$/m);
    // The threads' busy time is part of each chunk's time, so it is above 0 and at most their sum.
    const value = (name: string) => Number(new RegExp(`^${name}(?:\\{[^}]*\\})? (\\S+)$`, 'm').exec(workerMetrics)?.[1]);
    const busy = value('keyfleet_worker_pool_busy_seconds_total');
    expect(busy).toBeGreaterThan(0);
    expect(busy).toBeLessThanOrEqual(value('keyfleet_chunk_duration_seconds_sum'));
    const run = checkMetrics(workerMetrics);
    expect(run.status, run.output).toBe(0);
    expect(run.output.split('\n').filter((l) => /error/i.test(l))).toEqual([]);
  });

  it('exports the counters\' fixed label values at 0 before their first increment, so rate() sees the first one', () => {
    // Nothing in this traffic failed a chunk or a batch, cancelled one, or rotated a key by itself.
    const zero = (text: string, name: string, labels: string) => expect(text.split('\n'), `${name}{${labels}}`).toContain(`${name}{${labels}} 0`);
    zero(apiMetrics, 'keyfleet_batches_total', 'event="cancelled",component="api"');
    zero(apiMetrics, 'keyfleet_batches_total', 'event="failed",component="api"');
    zero(apiMetrics, 'keyfleet_key_auto_rotations_total', 'reason="period",component="api"');
    zero(apiMetrics, 'keyfleet_items_processed_total', 'op="rewrap",key_type="xchacha20-poly1305",outcome="failure",path="sync",component="api"');
    zero(workerMetrics, 'keyfleet_chunks_total', 'outcome="failed",component="worker"');
    zero(workerMetrics, 'keyfleet_batches_total', 'event="failed",component="worker"');
    zero(workerMetrics, 'keyfleet_key_auto_rotations_total', 'reason="nonce_budget",component="worker"');
    zero(workerMetrics, 'keyfleet_items_processed_total', 'op="decrypt",key_type="legacy-aes256-cbc",outcome="failure",path="batch",component="worker"');
    // Only the label values a process can count: a worker never sees an upload, legacy keys never encrypt.
    expect(workerMetrics).not.toMatch(/^keyfleet_batches_total\{event="created"/m);
    expect(`${apiMetrics}${workerMetrics}`).not.toMatch(/op="encrypt",key_type="legacy-aes256-cbc"/);
  });

  it('has every metric the Grafana dashboard and the alert rules query', () => {
    const dashboard = JSON.parse(readFileSync(resolve(root, 'dashboards/grafana/dashboards/keyfleet.json'), 'utf8')) as Doc;
    expect(dashboard['uid']).toBe('keyfleet');
    expect(dashboard['schemaVersion']).toBeGreaterThanOrEqual(36);
    const panels = (dashboard['panels'] as Doc[]).flatMap((p) => [p, ...((p['panels'] as Doc[] | undefined) ?? [])]);
    const targets = panels.flatMap((p) => ((p['targets'] as Doc[] | undefined) ?? []).map((t) => ({ panel: p['title'] as string, target: t })));
    expect(targets.length).toBeGreaterThan(10);
    for (const { panel, target } of targets) expect(target['datasource']?.uid, panel).toBe('prometheus');

    const exported = new Set([...sampleNames(apiMetrics), ...sampleNames(workerMetrics)]);
    const queries = [...targets.map(({ panel, target }) => ({ where: `panel "${panel}"`, expr: target['expr'] as string })), ...alertRules().map((r) => ({ where: `alert ${r['alert']}`, expr: r['expr'] as string }))];
    const missing: string[] = [];
    for (const { where, expr } of queries) {
      // Every keyfleet_ identifier, then every metric name at all, is a series really exported (or `up`).
      for (const name of expr.match(/keyfleet_[a-z_]+/g) ?? []) if (!exported.has(name)) missing.push(`${where}: ${name}`);
      const names = metricNamesIn(expr);
      expect(names.length, `${where}: ${expr}`).toBeGreaterThan(0);
      for (const name of names) if (name !== 'up' && !exported.has(name)) missing.push(`${where}: ${name}`);
    }
    expect(missing).toEqual([]);
  });

  it('recognises a metric that is not exported (the name check can fail)', () => {
    expect(metricNamesIn('histogram_quantile(0.99, sum by (le, op) (rate(keyfleet_chunk_duration_seconds[$__rate_interval])))')).toEqual(['keyfleet_chunk_duration_seconds']);
    expect(sampleNames(workerMetrics).has('keyfleet_chunk_duration_seconds')).toBe(false);
    expect(metricNamesIn('count(up{job="keyfleet-worker"} == 1) or vector(0)')).toEqual(['up']);
  });
});
