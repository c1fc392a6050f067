import { execFileSync } from 'node:child_process';
import { hash, randomBytes } from 'node:crypto';
import { resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import { loadConfig, shownRedisUrl } from '../../shared/config.js';
import { nativeKernel } from '../../shared/crypto/native-kernel.js';
import { MasterKey } from '../../shared/master-key.js';
import { matchDigest, parseTokens, TokenVerifier, type DigestMatcher } from '../../shared/tokens.js';

const masterKey = randomBytes(32).toString('base64');

/** loadConfig's error message for `env`, or '' where it loads. */
function errorOf(env: Record<string, string>): string {
  try {
    loadConfig(env);
  } catch (e) {
    return (e as Error).message;
  }
  return '';
}
const tokensError = (tokens: string): string => errorOf({ KEYFLEET_TOKENS: tokens });

describe('configuration', () => {
  it('has the documented defaults and is frozen', () => {
    const config = loadConfig({});
    expect(config).toMatchObject({ redisUrl: 'redis://127.0.0.1:6379', host: '127.0.0.1', port: 8080, prefix: '{keyfleet}', syncMaxItems: 1000, chunkItems: 10_000, resultTtlSeconds: 86_400 });
    expect(Object.isFrozen(config)).toBe(true);
  });

  it('gives one tenant half of MAX_BODY_BYTES_IN_FLIGHT unless MAX_TENANT_BODY_BYTES_IN_FLIGHT says otherwise', () => {
    expect(loadConfig({})).toMatchObject({ maxBodyBytesInFlight: 48 * 1024 * 1024, maxTenantBodyBytesInFlight: 24 * 1024 * 1024 });
    expect(loadConfig({ MAX_BODY_BYTES_IN_FLIGHT: '3000000' }).maxTenantBodyBytesInFlight).toBe(1_500_000);
    expect(loadConfig({ MAX_TENANT_BODY_BYTES_IN_FLIGHT: '50331648' }).maxTenantBodyBytesInFlight).toBe(50_331_648);
    expect(errorOf({ MAX_TENANT_BODY_BYTES_IN_FLIGHT: '10' })).toMatch(/MAX_TENANT_BODY_BYTES_IN_FLIGHT: /);
  });

  it('keeps Bull Board read-only unless BULL_BOARD_ACTIONS is true or 1', () => {
    expect(['', 'false', '0', 'true', '1'].map((v) => loadConfig(v === '' ? {} : { BULL_BOARD_ACTIONS: v }).bullBoardActions)).toEqual([false, false, false, true, true]);
    expect(errorOf({ BULL_BOARD_ACTIONS: 'yes' })).toMatch(/BULL_BOARD_ACTIONS: /);
  });

  it('fails naming the variable, what it expected and what it got', () => {
    expect(() => loadConfig({ PORT: 'eighty' })).toThrow(/PORT: .*\(got "eighty"\)/);
    expect(() => loadConfig({ KEYFLEET_PREFIX: 'keyfleet' })).toThrow(/KEYFLEET_PREFIX: expected a hash tag/);
  });

  it('never echoes a bad master key or token list, only their shape', () => {
    const bad = 'c2VjcmV0LW1hdGVyaWFs';
    const error = (() => { try { loadConfig({ KEYFLEET_MASTER_KEY: bad }); } catch (e) { return (e as Error).message; } return ''; })();
    expect(error).toMatch(/KEYFLEET_MASTER_KEY: expected base64 of exactly 32 bytes/);
    expect(error).not.toContain(bad);
    const tokenError = (() => { try { loadConfig({ KEYFLEET_TOKENS: 'acme:short-secret' }); } catch (e) { return (e as Error).message; } return ''; })();
    expect(tokenError).toMatch(/KEYFLEET_TOKENS: .*at least 16 characters/);
    expect(tokenError).not.toContain('short-secret');
    expect(loadConfig({ KEYFLEET_MASTER_KEY: masterKey }).masterKey?.length).toBe(32);
  });

  it('never echoes the password of a bad REDIS_URL, but shows the rest', () => {
    const error = (() => { try { loadConfig({ REDIS_URL: 'redis://app:Sup3rSecretPw@redis.internal:6379 ' }); } catch (e) { return (e as Error).message; } return ''; })();
    expect(error).toMatch(/REDIS_URL: expected a redis:\/\/ .*redis\.internal:6379/);
    expect(error).not.toContain('Sup3rSecretPw');
    const odd = (() => { try { loadConfig({ REDIS_URL: 'redis://:p@ss/w0rd@h1:6379,redis://:p@ss/w0rd@h2 x' }); } catch (e) { return (e as Error).message; } return ''; })();
    expect(odd).toMatch(/REDIS_URL: .*h1:6379/);
    expect(odd).not.toMatch(/ss\/w0rd/);
  });

  it('refuses a REDIS_URL database that is not a whole number Redis can select, instead of crashing at the first command or reading /1x as 1', () => {
    const refused = [
      'redis://h:6379/abc', 'redis://h:6379/1x', 'redis://h:6379/-1', 'redis://h:6379/1.5', 'redis://h:6379/%31', 'redis://h:6379/0/',
      'redis://h:6379/2147483647', 'redis://h:6379/99999999999', 'redis://h:6379?db=abc', 'redis://h:6379/?db=', 'rediss://u:p@h:6380/x',
      'redis://h1:6379,redis://h2:6379/x',
    ];
    for (const url of refused) {
      const shown = JSON.stringify(url.replace('u:p@', '…@'));
      expect(errorOf({ REDIS_URL: url }), url).toBe(`invalid configuration:\n  REDIS_URL: expected the database after the host to be a whole number from 0 to 2147483646, as in redis://host:6379/2 (got ${shown})`);
    }
    for (const url of ['redis://h:6379', 'redis://h:6379/', 'redis://h:6379/0', 'redis://h:6379/15', 'redis://h:6379/2147483646', 'redis://h:6379?db=3', 'rediss://u:p@h:6380/2']) {
      expect(loadConfig({ REDIS_URL: url }).redisUrl, url).toBe(url);
    }
    // A Redis Cluster has database 0 alone, and the cluster client would quietly use it.
    for (const url of ['redis://h1:6379/0,redis://h2:6379/3', 'redis://h1:6379?db=1']) {
      expect(errorOf({ REDIS_URL: url, REDIS_CLUSTER: 'true' }), url).toBe(`invalid configuration:\n  REDIS_URL: a Redis Cluster (REDIS_CLUSTER=true) has database 0 alone (got ${JSON.stringify(url)})`);
    }
    expect(loadConfig({ REDIS_URL: 'redis://h1:6379/0,redis://h2:6379', REDIS_CLUSTER: 'true' }).redisCluster).toBe(true);
  });

  it('shows no piece of a REDIS_URL password in an error, even one with raw commas, and still the hosts', () => {
    const pieces = Array.from({ length: 4 }, () => randomBytes(5).toString('hex'));
    const passwords = [pieces.join(','), `${pieces[0]}, ${pieces[1]}@${pieces[2]},${pieces[3]}`, `${pieces[0]},\n${pieces[1]},redis.internal:6379`];
    for (const password of passwords) {
      for (const [url, hosts] of [
        [`redis://:${password}@redis.internal:6379`, ['redis.internal:6379']],
        [`rediss://app:${password}@redis.internal:6380/abc`, ['redis.internal:6380/abc']],
        [`redis://:${password}@h1:6379,redis://:${password}@h2:6379`, ['h1:6379', 'h2:6379']],
        // Mistyped without its //, or without the scheme.
        [`redis:/:${password}@redis.internal:6379`, ['redis.internal:6379']],
        [`app:${password}@redis.internal:6379`, ['redis.internal:6379']],
      ] as const) {
        const error = errorOf({ REDIS_URL: url });
        expect(error).toMatch(/^invalid configuration:\n {2}REDIS_URL: /);
        for (const piece of pieces) expect(error).not.toContain(piece);
        for (const host of hosts) expect(error).toContain(host);
      }
    }
    // Written as a URL has it, a comma is %2C, and the client decodes it.
    expect(loadConfig({ REDIS_URL: `redis://:${pieces.join('%2C')}@redis.internal:6379` }).redisUrl).toContain('%2C');
  });

  it('refuses a duration that Node’s timers cannot hold (they would fire after 1 ms), naming the variable, the maximum and the value', () => {
    for (const [name, max] of [['UPLOAD_IDLE_SECONDS', 2_147_483], ['WORKER_DRAIN_SECONDS', 2_147_483], ['JOB_LOCK_MS', 2 ** 31 - 1]] as const) {
      expect(errorOf({ [name]: String(max + 1) })).toMatch(new RegExp(`${name}: expected at most ${max} .*\\(got "${max + 1}"\\)`));
      expect(errorOf({ [name]: '1e12' })).toMatch(new RegExp(`${name}: expected at most ${max} `));
      expect(errorOf({ [name]: String(max) })).toBe('');
    }
    // Each becomes a timer of up to 2^31−1 ms, seconds × 1000 included.
    const longest = loadConfig({ UPLOAD_IDLE_SECONDS: '2147483', WORKER_DRAIN_SECONDS: '2147483', JOB_LOCK_MS: String(2 ** 31 - 1) });
    for (const ms of [longest.uploadIdleSeconds * 1000, longest.workerDrainSeconds * 1000, longest.jobLockMs]) expect(ms).toBeLessThanOrEqual(2 ** 31 - 1);
  });

  it('refuses a RESULT_TTL_SECONDS whose doubled lifetime Redis would refuse as an expiry, naming the variable, the maximum and the value', () => {
    const max = 2 ** 52;
    for (const value of [String(max + 1), String(Number.MAX_SAFE_INTEGER), '1e16']) {
      expect(errorOf({ RESULT_TTL_SECONDS: value })).toMatch(new RegExp(`RESULT_TTL_SECONDS: expected at most ${max} s .*\\(got "${value}"\\)`));
    }
    expect(loadConfig({ RESULT_TTL_SECONDS: String(max) }).resultTtlSeconds).toBe(max);
  });

  it('reads an empty variable as unset: its default applies, not 0', () => {
    expect(loadConfig({ PORT: '', SYNC_RATE_LIMIT: ' ', CHUNK_ITEMS: '' })).toMatchObject({ port: 8080, syncRateLimit: 5_000, chunkItems: 10_000 });
    expect(loadConfig({ SYNC_RATE_LIMIT: '0' }).syncRateLimit).toBe(0);
  });

  it('names every bad variable in one start: a bad token list or a cluster’s database alongside the others, not only once the rest is right', () => {
    const shortToken = randomBytes(4).toString('hex');
    const error = errorOf({ KEYFLEET_TOKENS: `t1:${shortToken}`, SYNC_MAX_ITEMS: '-1', LOG_LEVEL: 'loud', REDIS_URL: 'redis://h:6379/3', REDIS_CLUSTER: 'true' });
    expect(error.split('\n').map((line) => line.trim().split(':')[0])).toEqual(['invalid configuration', 'SYNC_MAX_ITEMS', 'LOG_LEVEL', 'REDIS_URL', 'KEYFLEET_TOKENS']);
    expect(error).toContain('KEYFLEET_TOKENS: entry 1: expected a token of at least 16 characters');
    expect(error).not.toContain(shortToken);
    // What a process requires is named with the rest: unset, or a token list of commas alone.
    for (const tokens of [undefined, ',', ' , ']) {
      const given = { SYNC_MAX_ITEMS: '-1', ...(tokens === undefined ? {} : { KEYFLEET_TOKENS: tokens }) };
      const required = (() => { try { loadConfig(given, ['KEYFLEET_TOKENS', 'KEYFLEET_MASTER_KEY']); } catch (e) { return (e as Error).message; } return ''; })();
      expect(required.split('\n').map((line) => line.trim().split(':')[0])).toEqual(['invalid configuration', 'SYNC_MAX_ITEMS', 'KEYFLEET_TOKENS', 'KEYFLEET_MASTER_KEY']);
    }
  });

  it('shows a REDIS_URL without its password where npm start prints it, each URL of a seed list', () => {
    expect(shownRedisUrl('redis://127.0.0.1:6379')).toBe('redis://127.0.0.1:6379');
    expect(shownRedisUrl('rediss://app:p@ss,word@h1:6380, redis://:pw@[::1]:6379')).toBe('rediss://…@h1:6380, redis://…@[::1]:6379');
    // ioredis reads a password from the query too.
    expect(shownRedisUrl('redis://redis:6379/0?password=hunter2&family=6,redis://:p?w@h2:6379?db=2&username=u&sentinelPassword=s')).toBe('redis://redis:6379/0?password=…&family=6,redis://…@h2:6379?db=2&username=…&sentinelPassword=…');
  });

  it('refuses an empty REDIS_URL instead of reading it as unset: the default would be a Redis on 127.0.0.1 where another was meant', () => {
    for (const empty of ['', ' ', '\n']) {
      expect(() => loadConfig({ REDIS_URL: empty }), JSON.stringify(empty)).toThrow(
        `invalid configuration:\n  REDIS_URL: set but empty: expected a redis:// or rediss:// URL, or no REDIS_URL at all for the default redis://127.0.0.1:6379 (got ${JSON.stringify(empty)})`,
      );
    }
    expect(loadConfig({}).redisUrl).toBe('redis://127.0.0.1:6379');
  });
});

describe('tokens', () => {
  it('gives an entry without scopes everything but admin, and an entry with scopes exactly those', () => {
    const [plain, scoped] = parseTokens('acme:aaaaaaaaaaaaaaaa, globex:bbbbbbbbbbbbbbbb:encrypt+admin');
    expect([...plain!.scopes].sort()).toEqual(['batches', 'decrypt', 'encrypt', 'keys', 'rewrap']);
    expect([...scoped!.scopes].sort()).toEqual(['admin', 'encrypt']);
    expect(() => parseTokens('acme:aaaaaaaaaaaaaaaa:encrypt+root')).toThrow('entry 1: expected scopes among encrypt, decrypt, rewrap, keys, batches, admin, joined by +');
  });

  it('refuses a token longer than the API reads (512 characters), without showing it', () => {
    const tooLong = `tok_${'x'.repeat(505)}`.padEnd(513, 'y');
    const error = (() => { try { loadConfig({ KEYFLEET_TOKENS: `acme:aaaaaaaaaaaaaaaa,globex:${tooLong}` }); } catch (e) { return (e as Error).message; } return ''; })();
    expect(error).toMatch(/KEYFLEET_TOKENS: entry 2: expected a token of at most 512 characters, got 513/);
    expect(error).not.toContain('xxxxxxxx');
    expect(parseTokens(`globex:${tooLong.slice(0, 512)}`)[0]?.token).toHaveLength(512);
  });

  it('refuses a token that cannot be sent after Bearer (a space, a control or a non-ASCII character), naming the entry and the rule, not the token', () => {
    for (const bad of [' ', '\t', '\u0000', '\u007f', '\u00a0', 'ü', '€']) {
      const error = tokensError(`acme:aaaaaaaaaaaaaaaa,globex:Xq7Zk9Wm${bad}Rt5Yp2Ln:encrypt`);
      expect(error).toMatch(/KEYFLEET_TOKENS: entry 2: expected a token of visible ASCII characters \(! to ~: no space, control or non-ASCII character\)/);
      expect(error).not.toMatch(/Xq7Zk9Wm|Rt5Yp2Ln/);
    }
    // Every visible ASCII character the entry format leaves (: and , separate entries and fields).
    const visible = Array.from({ length: 0x7e - 0x21 + 1 }, (_, i) => String.fromCharCode(0x21 + i)).filter((c) => c !== ':' && c !== ',').join('');
    expect(parseTokens(`acme:${visible}`)[0]?.token).toBe(visible);
  });

  it('shows no field of an entry that does not parse: a token read as a tenant name or a scope stays unshown', () => {
    const token = `tok_${randomBytes(12).toString('hex')}`;
    const cases: Array<[string, string]> = [
      [token, 'entry 1: expected tenant:token[:scope+scope] (a token holds no : or ,)'], // the tenant left out
      [`${token}:encrypt`, 'entry 1: expected a token of at least 16 characters'], // the token read as the tenant
      [`${token}:encrypt+decrypt+rewrap+keys`, 'entry 1: expected tenant:token[:scope+scope], got scopes where the token goes (is the tenant missing?)'], // a guessable token
      [`acme:${token.slice(0, 20)}:${token.slice(20)}`, 'entry 1: expected scopes among encrypt, decrypt, rewrap, keys, batches, admin, joined by +'], // a token with a :
      [`acme:${token}:encrypt:admin`, 'entry 1: expected tenant:token[:scope+scope] (a token holds no : or ,)'],
    ];
    for (const [spec, expected] of cases) {
      const error = tokensError(spec);
      expect(error).toBe(`invalid configuration:\n  KEYFLEET_TOKENS: ${expected}`);
      for (const piece of [token, token.slice(0, 20), token.slice(20)]) expect(error).not.toContain(piece);
    }
  });

  it('refuses a token given to two entries (the second would never be found), naming the entries and not the token', () => {
    const token = `tok_${randomBytes(12).toString('hex')}`;
    for (const spec of [`acme:${token}:encrypt,globex:${token}:decrypt+keys`, `acme:${token}:encrypt,acme:bbbbbbbbbbbbbbbb,acme:${token}:admin`]) {
      const error = tokensError(spec);
      expect(error).toMatch(/KEYFLEET_TOKENS: entry (2|3): expected a token of its own, got the token of entry 1/);
      expect(error).not.toContain(token);
    }
    expect(parseTokens(`acme:${token},globex:${token}x`)).toHaveLength(2);
  });

  const matchers: Array<[string, DigestMatcher]> = [['node:crypto', matchDigest], ['the native kernel', (token, digests) => nativeKernel!.tokenIndex(token, digests)]];

  it.each(matchers)('verifies the right token only (digests matched by %s)', (_, match) => {
    const verifier = new TokenVerifier(parseTokens('acme:aaaaaaaaaaaaaaaa,globex:bbbbbbbbbbbbbbbb:encrypt'), match);
    expect(verifier.verify('aaaaaaaaaaaaaaaa')?.tenant).toBe('acme');
    expect(verifier.verify('bbbbbbbbbbbbbbbb')).toEqual({ tenant: 'globex', scopes: new Set(['encrypt']) });
    for (const wrong of ['', 'aaaaaaaaaaaaaaa', 'aaaaaaaaaaaaaaaaa', 'AAAAAAAAAAAAAAAA', 'bbbbbbbbbbbbbbbb ']) expect(verifier.verify(wrong)).toBeUndefined();
  });

  it('finds the same entry with the native kernel as with node:crypto, whatever is presented', () => {
    // Presented tokens arrive through HTTP Basic too, so any string: non-ASCII, lone surrogates
    // (both encode them as U+FFFD), up to the longest an entry can be (512 bytes) and longer.
    const presented = ['', 'x', 'é', '\ud800', 'a\ud83d\ude00b', '\ufffd', 'x'.repeat(512), 'é'.repeat(256), 'x'.repeat(513), 'é'.repeat(257), ...Array.from({ length: 50 }, () => randomBytes(24).toString('base64'))];
    const table = [...presented.filter((_, i) => i % 2 === 0), '\udfff'];
    const digests = Buffer.concat(table.map((t) => hash('sha256', t, 'buffer')));
    for (const token of [...presented, ...table, 'x'.repeat(511)]) {
      expect(nativeKernel!.tokenIndex(token, digests), JSON.stringify(token.slice(0, 20))).toBe(matchDigest(token, digests));
    }
    expect(nativeKernel!.tokenIndex('x'.repeat(512), digests)).toBe(table.indexOf('x'.repeat(512)));
    expect(nativeKernel!.tokenIndex('é'.repeat(256), digests)).toBe(table.indexOf('é'.repeat(256)));
    // A lone surrogate is U+FFFD to both, whichever one it is.
    for (const token of ['\ud800', '\ufffd']) expect(nativeKernel!.tokenIndex(token, digests)).toBe(table.length - 1);
    // Longer than any token KEYFLEET_TOKENS takes (512 bytes): never found by either, and not cut
    // short to be compared (at a character's edge, a cut would leave a string that could match).
    for (const [token, listed] of [['y'.repeat(513), 'y'.repeat(513)], ['é'.repeat(257), 'é'.repeat(257)], ['y'.repeat(1022) + 'é', 'y'.repeat(1022)], ['y'.repeat(1020) + '\ud83d\ude00', 'y'.repeat(1020)], ['y'.repeat(5000), 'y'.repeat(1023)]]) {
      const only = hash('sha256', listed!, 'buffer');
      expect([nativeKernel!.tokenIndex(token!, only), matchDigest(token!, only)]).toEqual([-1, -1]);
    }
    expect(() => nativeKernel!.tokenIndex(42 as unknown as string, digests)).toThrow(/tokenIndex\(token, digests\)/);
    expect(() => nativeKernel!.tokenIndex('x', digests.subarray(0, 31))).toThrow(/32-byte digests/);
  });
});

describe('master key wrapping', () => {
  it('unwraps only for the same tenant, key name, version and master key', () => {
    const master = new MasterKey(randomBytes(32));
    const material = randomBytes(32);
    const wrapped = master.wrap(material, 'acme', 'serials', 3);
    expect(master.unwrap(wrapped, 'acme', 'serials', 3).equals(material)).toBe(true);
    expect(() => master.unwrap(wrapped, 'globex', 'serials', 3)).toThrow();
    expect(() => master.unwrap(wrapped, 'acme', 'other', 3)).toThrow();
    expect(() => master.unwrap(wrapped, 'acme', 'serials', 4)).toThrow();
    expect(() => new MasterKey(randomBytes(32)).unwrap(wrapped, 'acme', 'serials', 3)).toThrow(/another master key/);
  });
});

describe('worker priority', () => {
  /** Lowers a child process's priority (lowering this one's would slow the rest of the suite); what each thread then has. */
  function lowerInChild(priority: { nice: number; idle: boolean }): { lowered: { nice: boolean; idle: boolean }; nice: number[]; policy: number[] } {
    const script = `
      import { readdirSync, readFileSync } from 'node:fs';
      import { Worker } from 'node:worker_threads';
      import { lowerProcessPriority } from ${JSON.stringify(resolve(import.meta.dirname, '../../dist/shared/priority.js'))};
      const lowered = lowerProcessPriority(${JSON.stringify(priority)});
      const worker = new Worker('setInterval(() => {}, 1e9)', { eval: true }); // alive until terminated below
      await new Promise((r) => worker.once('online', r));
      // /proc/<pid>/task/<tid>/stat after the command name: field 19 is the niceness, 41 the policy.
      const stats = readdirSync('/proc/self/task').map((t) => readFileSync('/proc/self/task/' + t + '/stat', 'utf8').split(') ')[1].split(' '));
      console.log(JSON.stringify({ lowered, nice: stats.map((f) => Number(f[16])), policy: stats.map((f) => Number(f[38])) }));
      await worker.terminate();`;
    return JSON.parse(execFileSync(process.execPath, ['--input-type=module', '-e', script], { encoding: 'utf8' }));
  }
  const SCHED_OTHER = 0;
  const SCHED_IDLE = 5;

  it.runIf(process.platform === 'linux')('lowers every thread of the process, helpers included, and threads started later inherit it', () => {
    const { lowered, nice, policy } = lowerInChild({ nice: 7, idle: false });
    expect(lowered).toEqual({ nice: true, idle: false });
    expect(nice.length).toBeGreaterThan(5);
    expect(new Set(nice)).toEqual(new Set([7]));
    expect(new Set(policy)).toEqual(new Set([SCHED_OTHER]));
  });

  it.runIf(process.platform === 'linux' && nativeKernel !== undefined)('puts every thread under SCHED_IDLE with WORKER_SCHED=idle, threads started later too', () => {
    const { lowered, nice, policy } = lowerInChild({ nice: 19, idle: true });
    expect(lowered).toEqual({ nice: true, idle: true });
    expect(policy.length).toBeGreaterThan(5);
    expect(new Set(policy)).toEqual(new Set([SCHED_IDLE]));
    expect(new Set(nice)).toEqual(new Set([19]));
  });
});
