import { spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { cpSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, symlinkSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { Ajv } from 'ajv';
import addFormats from 'ajv-formats';
import { describe, expect, it } from 'vitest';
import { parse, parseAllDocuments } from 'yaml';
import { PROMETHEUS_RULE_FILE, prometheusRule } from '../../scripts/prometheus-rule.js';
import { loadConfig } from '../../shared/config.js';

// The deployment files are code too: the compose file must be valid per the Compose
// Specification (test/fixtures/compose-spec.json) and keep the settings that protect data and
// scaling; the image must be multi-stage and unprivileged; the Kubernetes manifests must hang
// together (names, labels, probes, the autoscaler's target).

const root = resolve(import.meta.dirname, '..', '..');
const read = (path: string): string => readFileSync(resolve(root, path), 'utf8');

type Doc = Record<string, any>;

// Compose files use YAML 1.1 merge keys (`<<: *keyfleet-env`); the yaml package needs them enabled.
const compose = parse(read('docker-compose.yml'), { merge: true }) as Doc;
const services = compose['services'] as Record<string, Doc>;
const service = (name: string): Doc => {
  const s = services[name];
  if (!s) throw new Error(`docker-compose.yml has no service ${name}`);
  return s;
};

/**
 * Compose's interpolation of a value from the shell's environment, in the forms this file uses:
 * `${VAR}`, `${VAR:-default}` and `${VAR:?error}`, where an empty variable counts as unset.
 */
const interpolate = (value: string, shell: Record<string, string>): string =>
  value.replace(/\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:-|:\?)([^}]*))?\}/g, (_, name: string, op: string | undefined, arg: string | undefined) => {
    const set = shell[name];
    if (set) return set;
    if (op === ':?') throw new Error(`docker compose refuses to start: ${name}: ${arg}`);
    return arg ?? '';
  });
/** The configuration a compose service's process loads, given the shell's environment. */
const composeConfig = (name: string, shell: Record<string, string>) =>
  loadConfig(Object.fromEntries(Object.entries(service(name)['environment'] as Doc).map(([k, v]) => [k, interpolate(String(v), shell)])));

describe('docker-compose.yml', () => {
  it('is valid against the Compose Specification JSON schema', () => {
    const schema = JSON.parse(readFileSync(resolve(root, 'test/fixtures/compose-spec.json'), 'utf8')) as Doc;
    // The schema names its meta-schema as https://json-schema.org/draft-07/schema, an alias Ajv does
    // not register: drop it so Ajv validates the schema against its built-in draft-07 meta-schema.
    expect(schema['$schema']).toMatch(/draft-07/);
    delete schema['$schema'];
    const ajv = new Ajv({ strict: false, allErrors: true });
    addFormats.default(ajv);
    const validate = ajv.compile(schema);
    const valid = validate(compose);
    expect(validate.errors ?? [], ajv.errorsText(validate.errors)).toEqual([]);
    expect(valid).toBe(true);
  });

  it('keeps Redis durable (AOF on, noeviction) and health-checked', () => {
    const redis = service('redis');
    const command = (redis['command'] as string[]).join(' ');
    expect(command).toMatch(/--appendonly yes\b/);
    expect(command).toMatch(/--maxmemory-policy noeviction\b/);
    expect(redis['healthcheck']?.test).toEqual(expect.arrayContaining(['redis-cli', 'ping']));
  });

  it('builds the API and the worker from deploy/Dockerfile', () => {
    for (const name of ['api', 'worker']) {
      const build = service(name)['build'] as Doc;
      expect(build['context'], name).toBe('.');
      expect(build['dockerfile'], name).toBe('deploy/Dockerfile');
    }
    expect(existsSync(resolve(root, 'deploy/Dockerfile'))).toBe(true);
  });

  it('lets the worker scale: 2 replicas, no container_name, no fixed host port', () => {
    const worker = service('worker');
    expect(worker['deploy']?.replicas).toBe(2);
    expect(worker).not.toHaveProperty('container_name');
    for (const port of (worker['ports'] ?? []) as Array<string | number | Doc>) {
      // A published host port can be bound by one replica only.
      const published = typeof port === 'object' ? port['published'] : String(port).split(':').length > 1;
      expect(published, `worker port ${JSON.stringify(port)}`).toBeFalsy();
    }
  });

  it('makes every worker scrapeable and health-checked on its metrics port', () => {
    const worker = service('worker');
    expect(worker['environment']?.HOST).toBe('0.0.0.0');
    // The merged anchor still gives it Redis and the master key.
    expect(worker['environment']?.REDIS_URL).toBe('redis://redis:6379');
    expect(worker['environment']?.KEYFLEET_MASTER_KEY).toMatch(/^\$\{KEYFLEET_MASTER_KEY:\?/);
    expect((worker['healthcheck']?.test as string[]).join(' ')).toContain('http://127.0.0.1:9464/readyz');
  });

  it('mounts the Prometheus config, its rule file at the path prometheus.yml names, and the Grafana provisioning read-only', () => {
    const prometheusConfig = parse(read('dashboards/prometheus.yml')) as Doc;
    const mounts = (name: string): Map<string, string> =>
      new Map(
        (service(name)['volumes'] as string[]).map((v) => {
          const [source, target, mode] = v.split(':');
          return [target ?? '', `${source}:${mode ?? ''}`];
        }),
      );
    const prom = mounts('prometheus');
    expect(prom.get('/etc/prometheus/prometheus.yml')).toBe('./dashboards/prometheus.yml:ro');
    for (const ruleFile of prometheusConfig['rule_files'] as string[]) expect(prom.get(ruleFile), ruleFile).toBe('./dashboards/alerts.yml:ro');
    const grafana = mounts('grafana');
    expect(grafana.get('/var/lib/grafana/dashboards')).toBe('./dashboards/grafana/dashboards:ro');
    expect(grafana.get('/etc/grafana/provisioning/datasources')).toBe('./dashboards/grafana/provisioning/datasources:ro');
    expect(grafana.get('/etc/grafana/provisioning/dashboards')).toBe('./dashboards/grafana/provisioning/dashboards:ro');
    for (const source of [...prom.values(), ...grafana.values()].filter((s) => s.startsWith('./'))) {
      expect(existsSync(resolve(root, source.slice(0, source.lastIndexOf(':')))), source).toBe(true);
    }
  });

  it('passes WEBHOOK_SECRET and WEBHOOK_ALLOWED_HOSTS from the shell to the API and the workers alike, and starts without them', () => {
    const shell = { KEYFLEET_MASTER_KEY: randomBytes(32).toString('base64'), KEYFLEET_TOKENS: `acme:${randomBytes(24).toString('hex')}` };
    const webhookSecret = randomBytes(24).toString('hex');
    for (const name of ['api', 'worker']) {
      const config = composeConfig(name, { ...shell, WEBHOOK_SECRET: webhookSecret, WEBHOOK_ALLOWED_HOSTS: 'hooks.example.com,*.example.org' });
      expect(config.webhookSecret, name).toBe(webhookSecret);
      expect(config.webhookAllowedHosts, name).toEqual(['hooks.example.com', '*.example.org']);
      // Unset in the shell: an empty variable, which shared/config.ts reads as unset (no 16-character minimum to fail).
      expect(composeConfig(name, shell).webhookSecret, name).toBeUndefined();
    }
  });

  it('passes KEYFLEET_MASTER_KEY_PREVIOUS from the shell to the API and the workers alike, for a master-key rotation (SECURITY.md)', () => {
    const [current, previous] = [randomBytes(32), randomBytes(32)];
    const shell = { KEYFLEET_MASTER_KEY: current.toString('base64'), KEYFLEET_TOKENS: `acme:${randomBytes(24).toString('hex')}` };
    for (const name of ['api', 'worker']) {
      expect(composeConfig(name, { ...shell, KEYFLEET_MASTER_KEY_PREVIOUS: previous.toString('base64') }).previousMasterKey, name).toEqual(previous);
      expect(composeConfig(name, shell).previousMasterKey, name).toBeUndefined();
    }
  });

  it('keeps Grafana closed by default: anonymous access off, admin password from the environment', () => {
    const env = service('grafana')['environment'] as Doc;
    expect(String(env['GF_AUTH_ANONYMOUS_ENABLED'])).toMatch(/^(false|\$\{[A-Z_]+:-false\})$/);
    expect(env['GF_SECURITY_ADMIN_PASSWORD']).toMatch(/^\$\{[A-Z_]+(:-[^}]+)?\}$/);
  });
});

describe('deploy/Dockerfile', () => {
  const instructions = read('deploy/Dockerfile')
    .split('\n')
    .map((l) => l.trim())
    .filter((l) => l && !l.startsWith('#'));
  const froms = instructions.filter((l) => /^FROM\s/i.test(l));

  it('is a multi-stage build on an even-numbered (LTS) Node.js major >= 22', () => {
    expect(froms.length).toBeGreaterThanOrEqual(2);
    const stages = new Set<string>();
    for (const from of froms) {
      const [, image = '', alias] = /^FROM\s+(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?/i.exec(from) ?? [];
      if (!stages.has(image)) {
        const major = /^node:(\d+)(?:[.-]|$)/.exec(image)?.[1];
        expect(major, from).toBeDefined();
        expect(Number(major) % 2, `${from}: odd Node.js majors are never LTS`).toBe(0);
        expect(Number(major), from).toBeGreaterThanOrEqual(22);
      }
      if (alias) stages.add(alias);
    }
  });

  it('builds from what its build stage copies, and the final stage finds what it copies from there', () => {
    // No Docker engine here: the build stage is replayed in a temp dir. Its COPY sources are
    // copied in; `npm ci` is stood in for by this checkout's node_modules and native build.
    const stage = instructions.slice(0, instructions.findIndex((l, i) => i > 0 && /^FROM\s/i.test(l)));
    const final = instructions.slice(instructions.findLastIndex((l) => /^FROM\s/i.test(l)));
    const dir = mkdtempSync(join(tmpdir(), 'keyfleet-image-'));
    try {
      for (const copy of stage.filter((l) => /^COPY\s/i.test(l))) {
        const sources = copy.split(/\s+/).slice(1, -1).filter((a) => !a.startsWith('--'));
        for (const source of sources) cpSync(resolve(root, source), join(dir, source), { recursive: true });
      }
      symlinkSync(resolve(root, 'node_modules'), join(dir, 'node_modules'));
      if (existsSync(resolve(root, 'build'))) cpSync(resolve(root, 'build'), join(dir, 'build'), { recursive: true });
      expect(stage.some((l) => /^RUN\s.*npm run build\b/.test(l))).toBe(true);
      const build = spawnSync('npm', ['run', 'build', '--silent'], { cwd: dir, encoding: 'utf8' });
      expect(build.status, build.stdout + build.stderr).toBe(0);
      const fromBuild = final.filter((l) => /^COPY\s+(?:--\S+\s+)*--from=build\b/i.test(l)).flatMap((l) => l.split(/\s+/).slice(1, -1).filter((a) => !a.startsWith('--')));
      expect(fromBuild).toContain('/app/dist');
      for (const source of fromBuild) {
        const path = join(dir, source.replace(/^\/app\//, ''));
        // The native kernel comes from `npm ci`; where this checkout has none, there is nothing to check.
        if (source.startsWith('/app/build/') && !existsSync(resolve(root, 'build'))) continue;
        expect(existsSync(path), source).toBe(true);
      }
      for (const entry of ['dist/producer/main.js', 'dist/worker/main.js', 'dist/client/cli.js']) expect(existsSync(join(dir, entry)), entry).toBe(true);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('fails its build stage, right after npm ci, when the native kernel did not build', () => {
    // The install script falls back to node:crypto, so npm ci succeeds without the addon.
    const ci = instructions.findIndex((l) => /^RUN\s+npm ci\b/.test(l));
    const check = instructions[ci + 1] ?? '';
    expect(check, 'the instruction after npm ci').toMatch(/^RUN\s.*keyfleet_kernel\.node/);
    const run = (cwd: string) => spawnSync('sh', ['-c', check.replace(/^RUN\s+/, '')], { cwd, encoding: 'utf8' });
    const dir = mkdtempSync(join(tmpdir(), 'keyfleet-image-'));
    try {
      expect(run(dir).status, 'without the addon').not.toBe(0);
      if (existsSync(resolve(root, 'build/Release/keyfleet_kernel.node'))) {
        cpSync(resolve(root, 'build/Release/keyfleet_kernel.node'), join(dir, 'build/Release/keyfleet_kernel.node'));
        const built = run(dir);
        expect(built.status, built.stderr).toBe(0);
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('runs the final stage as a user that is not root', () => {
    const lastFrom = instructions.findLastIndex((l) => /^FROM\s/i.test(l));
    const users = instructions.slice(lastFrom).filter((l) => /^USER\s/i.test(l));
    const user = users.at(-1)?.split(/\s+/)[1];
    expect(user).toBeDefined();
    expect(['root', '0'], `USER ${user}`).not.toContain(user!.split(':')[0]);
  });
});

describe('deploy/k8s', () => {
  const dir = resolve(root, 'deploy/k8s');
  const files = readdirSync(dir).filter((f) => f.endsWith('.yaml'));
  const docs: Array<{ file: string; doc: Doc }> = files.flatMap((file) =>
    parseAllDocuments(readFileSync(resolve(dir, file), 'utf8')).map((d) => {
      if (d.errors.length > 0) throw new Error(`${file}: ${d.errors.map((e) => e.message).join('; ')}`);
      return { file, doc: d.toJS() as Doc };
    }),
  );
  const find = (kind: string, name: string): Doc => {
    const found = docs.find(({ doc }) => doc['kind'] === kind && doc['metadata']?.name === name);
    if (!found) throw new Error(`no ${kind} ${name} in deploy/k8s`);
    return found.doc;
  };
  const container = (deployment: Doc): Doc => {
    const c = (deployment['spec']?.template?.spec?.containers as Doc[] | undefined)?.[0];
    if (!c) throw new Error(`Deployment ${deployment['metadata']?.name} has no container`);
    return c;
  };
  /** A probe's port as a number, resolving a named container port. */
  const probePort = (c: Doc, probe: Doc): number => {
    const port = probe['httpGet']?.port as string | number;
    if (typeof port === 'number') return port;
    return (c['ports'] as Doc[]).find((p) => p['name'] === port)?.containerPort as number;
  };
  const envOf = (c: Doc, name: string): Doc | undefined => (c['env'] as Doc[] | undefined)?.find((e) => e['name'] === name);
  const api = find('Deployment', 'keyfleet-api');
  const worker = find('Deployment', 'keyfleet-worker');
  /** CPU in cores, from a quantity such as "2" or "500m". */
  const cores = (quantity: string | number): number => (String(quantity).endsWith('m') ? Number.parseInt(String(quantity), 10) / 1000 : Number(quantity));
  /**
   * The environment the kubelet gives a container (makeEnvironmentVariables, pkg/kubelet): its
   * envFrom sources first, then each `env` entry over them; an optional secretKeyRef whose key the
   * Secret lacks is skipped, so what envFrom gave stays. `secret` is the data of the Secret keyfleet.
   */
  const podEnv = (c: Doc, secret: Record<string, string>): Record<string, string> => {
    const env: Record<string, string> = {};
    for (const from of (c['envFrom'] ?? []) as Doc[]) {
      if (!from['configMapRef']) throw new Error(`envFrom ${JSON.stringify(from)} is not modelled here`);
      for (const [k, v] of Object.entries(find('ConfigMap', from['configMapRef'].name as string)['data'] as Doc)) env[k] = String(v);
    }
    for (const e of (c['env'] ?? []) as Doc[]) {
      const name = e['name'] as string;
      const secretRef = e['valueFrom']?.secretKeyRef as Doc | undefined;
      const fieldRef = e['valueFrom']?.resourceFieldRef as Doc | undefined;
      if (!e['valueFrom']) env[name] = String(e['value'] ?? '');
      else if (secretRef) {
        expect(secretRef['name'], name).toBe('keyfleet');
        const value = secret[secretRef['key'] as string];
        if (value !== undefined) env[name] = value;
        else if (secretRef['optional'] !== true) throw new Error(`${name}: the Secret has no ${secretRef['key']} and the reference is not optional, so the pod would not start`);
      } else if (fieldRef?.resource === 'requests.cpu') env[name] = String(Math.ceil(cores(c['resources'].requests.cpu) / cores(fieldRef['divisor'] ?? 1)));
      else throw new Error(`${name}: ${JSON.stringify(e['valueFrom'])} is not modelled here`);
    }
    return env;
  };
  /** The Secret keyfleet with what it must hold (configmap.yaml shows how to create it). */
  const requiredSecrets = { KEYFLEET_MASTER_KEY: randomBytes(32).toString('base64'), KEYFLEET_TOKENS: `acme:${randomBytes(24).toString('hex')}` };

  it('parses every document of every file, each with apiVersion, kind and metadata.name', () => {
    expect(files).toEqual(expect.arrayContaining(['api.yaml', 'worker.yaml', 'configmap.yaml', 'keda-scaledobject.yaml', 'pdb.yaml', 'kustomization.yaml']));
    for (const { file, doc } of docs) {
      expect(typeof doc['apiVersion'], file).toBe('string');
      expect(typeof doc['kind'], file).toBe('string');
      expect(typeof doc['metadata']?.name, `${file} ${doc['kind']}`).toBe('string');
    }
  });

  it('lists in the kustomization exactly the manifests there are, all existing', () => {
    const kustomization = docs.find(({ doc }) => doc['kind'] === 'Kustomization')?.doc;
    const resources = kustomization?.['resources'] as string[];
    for (const r of resources) expect(existsSync(resolve(dir, r)), r).toBe(true);
    expect([...resources].sort()).toEqual(files.filter((f) => f !== 'kustomization.yaml').sort());
  });

  it('gives the worker time to drain its chunks, both probes on its metrics port, and HOST 0.0.0.0', () => {
    const spec = worker['spec']?.template?.spec as Doc;
    expect(spec['terminationGracePeriodSeconds']).toBeGreaterThanOrEqual(60);
    const c = container(worker);
    expect(c['readinessProbe']?.httpGet?.path).toBe('/readyz');
    expect(c['livenessProbe']?.httpGet?.path).toBe('/healthz');
    expect(probePort(c, c['readinessProbe'])).toBe(9464);
    expect(probePort(c, c['livenessProbe'])).toBe(9464);
    expect(envOf(c, 'HOST')?.value).toBe('0.0.0.0');
    // Threads follow the CPU the pod requests, not the node's core count.
    expect(envOf(c, 'WORKER_THREADS')?.valueFrom?.resourceFieldRef).toMatchObject({ resource: 'requests.cpu', containerName: c['name'] });
    expect(c['resources']?.requests?.cpu).toBeDefined();
  });

  it('runs the API with 2 replicas, secrets from the Secret keyfleet, a default REDIS_URL in the ConfigMap and probes on 8080', () => {
    expect(api['spec']?.replicas).toBe(2);
    const c = container(api);
    for (const name of ['KEYFLEET_MASTER_KEY', 'KEYFLEET_TOKENS']) {
      expect(envOf(c, name)?.valueFrom?.secretKeyRef, name).toEqual({ name: 'keyfleet', key: name });
    }
    const configMapName = (c['envFrom'] as Doc[]).find((e) => e['configMapRef'])?.configMapRef?.name as string;
    expect(find('ConfigMap', configMapName)['data']?.REDIS_URL).toMatch(/^rediss?:\/\//);
    expect(envOf(c, 'HOST')?.value).toBe('0.0.0.0');
    expect(c['readinessProbe']?.httpGet?.path).toBe('/readyz');
    expect(c['livenessProbe']?.httpGet?.path).toBe('/healthz');
    expect(probePort(c, c['readinessProbe'])).toBe(8080);
    expect(probePort(c, c['livenessProbe'])).toBe(8080);
    const svc = find('Service', 'keyfleet-api');
    expect(api['spec']?.template?.metadata?.labels).toMatchObject(svc['spec']?.selector as Doc);
  });

  it('takes REDIS_URL from the Secret keyfleet where it has one (a URL with a password), else from the ConfigMap, in both Deployments', () => {
    const managed = 'rediss://keyfleet:not-in-a-configmap@redis.example.net:6380';
    for (const deployment of [api, worker]) {
      const c = container(deployment);
      const name = deployment['metadata']?.name as string;
      expect(loadConfig(podEnv(c, requiredSecrets)).redisUrl, name).toBe(find('ConfigMap', 'keyfleet')['data']?.REDIS_URL);
      expect(loadConfig(podEnv(c, { ...requiredSecrets, REDIS_URL: managed })).redisUrl, name).toBe(managed);
    }
  });

  it('stops both Deployments at start, naming REDIS_URL, when the Secret keyfleet has the key empty, rather than reaching for 127.0.0.1', () => {
    // The `env` entry takes precedence over the ConfigMap's value even when empty (as from
    // --from-literal=REDIS_URL="$UNSET" or an empty value in a secret manager); read as unset, it
    // was the default, a Redis on the pod's own loopback.
    for (const deployment of [api, worker]) {
      const c = container(deployment);
      const name = deployment['metadata']?.name as string;
      for (const empty of ['', ' ', '\n']) {
        const env = podEnv(c, { ...requiredSecrets, REDIS_URL: empty });
        expect(env['REDIS_URL'], name).toBe(empty);
        expect(() => loadConfig(env), name).toThrow(/^invalid configuration:\n {2}REDIS_URL: set but empty/);
      }
    }
  });

  it('gives the API and the workers the same WEBHOOK_SECRET from the Secret keyfleet where it has one, and starts both without it', () => {
    const webhookSecret = randomBytes(24).toString('hex');
    // The allow-list is not a secret: the ConfigMap holds it, empty (any host at a public address) until set.
    expect(find('ConfigMap', 'keyfleet')['data']).toHaveProperty('WEBHOOK_ALLOWED_HOSTS');
    for (const deployment of [api, worker]) {
      const c = container(deployment);
      const name = deployment['metadata']?.name as string;
      expect(loadConfig(podEnv(c, { ...requiredSecrets, WEBHOOK_SECRET: webhookSecret })).webhookSecret, name).toBe(webhookSecret);
      expect(loadConfig(podEnv(c, requiredSecrets)).webhookSecret, name).toBeUndefined();
    }
  });

  it('runs both Deployments as a verifiable non-root uid on a read-only root filesystem, with resources', () => {
    for (const deployment of [api, worker]) {
      const podSecurity = deployment['spec']?.template?.spec?.securityContext as Doc;
      const c = container(deployment);
      const name = deployment['metadata']?.name as string;
      expect(podSecurity['runAsNonRoot'] ?? c['securityContext']?.runAsNonRoot, name).toBe(true);
      // The image's USER is a name (`node`); the kubelet can only verify runAsNonRoot with a numeric uid.
      expect(podSecurity['runAsUser'] ?? c['securityContext']?.runAsUser, name).toBeGreaterThan(0);
      expect(c['securityContext']?.readOnlyRootFilesystem, name).toBe(true);
      expect(c['resources']?.requests?.cpu, name).toBeDefined();
      expect(c['resources']?.limits?.memory, name).toBeDefined();
    }
  });

  it('autoscales the worker Deployment with KEDA on the item backlog, between 1 and 20 replicas', () => {
    const scaled = docs.find(({ doc }) => doc['kind'] === 'ScaledObject')?.doc;
    expect(scaled?.['spec']?.scaleTargetRef?.name).toBe(worker['metadata']?.name);
    expect(scaled?.['spec']?.scaleTargetRef?.kind ?? 'Deployment').toBe('Deployment');
    expect(scaled?.['spec']).toMatchObject({ minReplicaCount: 1, maxReplicaCount: 20 });
    expect(scaled?.['spec']?.cooldownPeriod).toBeGreaterThan(0);
    const triggers = scaled?.['spec']?.triggers as Doc[];
    expect(triggers.map((t) => t['type'])).toEqual(['prometheus']);
    expect(triggers[0]?.['metadata']?.query).toMatch(/\bkeyfleet_queue_backlog_items\b/);
    // The Deployment must not pin replicas that the autoscaler owns.
    expect(worker['spec']).not.toHaveProperty('replicas');
  });

  it('protects both Deployments with PodDisruptionBudgets that select their pods', () => {
    for (const deployment of [api, worker]) {
      const labels = deployment['spec']?.template?.metadata?.labels as Doc;
      const pdb = docs.find(
        ({ doc }) => doc['kind'] === 'PodDisruptionBudget' && Object.entries(doc['spec']?.selector?.matchLabels ?? {}).every(([k, v]) => labels[k] === v) && Object.keys(doc['spec']?.selector?.matchLabels ?? {}).length > 0,
      );
      expect(pdb, `PodDisruptionBudget for ${deployment['metadata']?.name}`).toBeDefined();
      const spec = pdb?.doc['spec'] as Doc;
      expect(spec['minAvailable'] ?? spec['maxUnavailable']).toBeDefined();
    }
  });
});

describe('API node flags', () => {
  it('are the same wherever the API is started (package.json, Dockerfile, compose, Kubernetes)', async () => {
    const { API_NODE_FLAGS } = await import('../../producer/node-flags.js');
    const flags = API_NODE_FLAGS.join(' ');
    const pkg = JSON.parse(readFileSync(resolve(root, 'package.json'), 'utf8')) as { scripts: Record<string, string> };
    expect(pkg.scripts['start:api']).toBe(`node ${flags} dist/producer/main.js`);
    const expected = JSON.stringify(['node', ...API_NODE_FLAGS, 'dist/producer/main.js']).replaceAll(',', ', ');
    expect(readFileSync(resolve(root, 'deploy/Dockerfile'), 'utf8')).toContain(`CMD ${expected}`);
    expect(readFileSync(resolve(root, 'docker-compose.yml'), 'utf8')).toContain(`command: ${expected}`);
    expect(readFileSync(resolve(root, 'deploy/k8s/api.yaml'), 'utf8')).toContain(`command: ${expected}`);
  });
});

describe('deploy/k8s/monitoring (Prometheus Operator)', () => {
  const dir = resolve(root, 'deploy/k8s/monitoring');
  const docs = readdirSync(dir)
    .filter((f) => f.endsWith('.yaml'))
    .flatMap((file) => parseAllDocuments(readFileSync(resolve(dir, file), 'utf8')).map((d) => ({ file, doc: d.toJS() as Doc })));
  const deployments = ['api.yaml', 'worker.yaml']
    .flatMap((file) => parseAllDocuments(readFileSync(resolve(root, 'deploy/k8s', file), 'utf8')).map((d) => d.toJS() as Doc))
    .filter((d) => d['kind'] === 'Deployment');

  it('lists in its kustomization exactly the manifests there are', () => {
    const kustomization = docs.find(({ doc }) => doc['kind'] === 'Kustomization')!.doc;
    const files = new Set(docs.map(({ file }) => file).filter((f) => f !== 'kustomization.yaml'));
    expect([...(kustomization['resources'] as string[])].sort()).toEqual([...files].sort());
  });

  it('scrapes the API and the workers on the named ports their pods expose, at /metrics', () => {
    const monitors = docs.filter(({ doc }) => doc['kind'] === 'PodMonitor').map(({ doc }) => doc);
    expect(monitors).toHaveLength(2);
    for (const deployment of deployments) {
      const template = deployment['spec'].template;
      const selecting = monitors.filter((m) => Object.entries(m['spec'].selector.matchLabels as Doc).every(([k, v]) => template.metadata.labels[k] === v));
      expect(selecting, deployment['metadata'].name).toHaveLength(1);
      const ports = (template.spec.containers[0].ports as Doc[]).map((p) => p['name']);
      for (const endpoint of selecting[0]!['spec'].podMetricsEndpoints as Doc[]) {
        expect(ports, deployment['metadata'].name).toContain(endpoint['port']);
        expect(endpoint['path']).toBe('/metrics');
      }
    }
  });

  it('carries the alerting rules of dashboards/alerts.yml as they are (run `npm run prometheus-rule` after changing them)', () => {
    const committed = readFileSync(resolve(root, PROMETHEUS_RULE_FILE), 'utf8');
    expect(committed).toBe(prometheusRule(readFileSync(resolve(root, 'dashboards/alerts.yml'), 'utf8')));
    const rule = parse(committed) as Doc;
    expect(rule['kind']).toBe('PrometheusRule');
    expect(rule['spec'].groups).toEqual((parse(readFileSync(resolve(root, 'dashboards/alerts.yml'), 'utf8')) as Doc)['groups']);
    expect(rule['spec'].groups.flatMap((g: Doc) => g['rules']).length).toBeGreaterThan(0);
  });
});
