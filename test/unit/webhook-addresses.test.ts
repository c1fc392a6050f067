import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { KeyfleetError } from '../../shared/errors.js';
import { checkCallbackUrl, isPublicAddress } from '../../shared/webhooks.js';
import { NonPublicAddressError, publicOnly, publicOnlyLookup } from '../../worker/webhook-delivery.js';

const secret = 'whsec_test_0123456789abcdef';

describe('webhook addresses without an allow-list', () => {
  it('counts only public unicast addresses as public', () => {
    for (const address of ['8.8.8.8', '93.184.216.34', '2606:4700::1111', '::ffff:8.8.8.8']) expect(isPublicAddress(address), address).toBe(true);
    const internal = [
      '127.0.0.1', '10.1.2.3', '172.16.0.1', '192.168.1.1', '169.254.169.254', '100.64.0.1', '0.0.0.0', '224.0.0.1',
      '255.255.255.255', '192.0.2.1', '198.18.0.1', '::1', '::', 'fe80::1', 'fd00:ec2::254', '::ffff:127.0.0.1', '::7f00:1', '64:ff9b::a00:1', '2002:a00:1::',
    ];
    for (const address of internal) expect(isPublicAddress(address), address).toBe(false);
    expect(isPublicAddress('hooks.example.com')).toBe(false);
  });

  it('refuses a callbackUrl at an internal address, however it is written, unless the allow-list names it', () => {
    const open = { secret, allowedHosts: [] };
    const refused = ['http://127.0.0.1:8080/hook', 'http://[::1]/hook', 'http://169.254.169.254/latest/meta-data/', 'http://2130706433/', 'http://0x7f.1/', 'http://[::ffff:7f00:1]/', 'http://[::127.0.0.1]/', 'https://10.0.0.7/hook'];
    for (const url of refused) {
      let error: unknown;
      try {
        checkCallbackUrl(url, open);
      } catch (err) {
        error = err;
      }
      expect(error, url).toBeInstanceOf(KeyfleetError);
      expect((error as KeyfleetError).code).toBe('KF_CALLBACK_URL_INVALID');
      expect((error as Error).message).toMatch(/is not a public address/);
    }
    // A name is resolved when the webhook is sent, not now; a public address passes.
    expect(checkCallbackUrl('https://hooks.example.com/keyfleet', open)).toBe('https://hooks.example.com/keyfleet');
    expect(checkCallbackUrl('http://93.184.216.34/hook', open)).toBe('http://93.184.216.34/hook');
    expect(checkCallbackUrl('http://127.0.0.1:8080/hook', { secret, allowedHosts: ['127.0.0.1'] })).toBe('http://127.0.0.1:8080/hook');
  });

  it('resolves a name to its public addresses only: localhost to none', async () => {
    const lookupAll = promisify((host: string, done: (err: Error | null, all?: unknown) => void) => publicOnlyLookup(host, { all: true }, done as never));
    await expect(lookupAll('localhost')).rejects.toBeInstanceOf(NonPublicAddressError);
    const lookupOne = promisify((host: string, done: (err: Error | null, address?: string) => void) => publicOnlyLookup(host, {}, done as never));
    await expect(lookupOne('127.0.0.1')).rejects.toBeInstanceOf(NonPublicAddressError);
    await expect(lookupOne('8.8.8.8')).resolves.toBe('8.8.8.8');
  });

  it('keeps the public addresses of a name that also resolves to internal ones, in either call style', async () => {
    const records = [
      { address: '10.0.0.5', family: 4 },
      { address: '93.184.216.34', family: 4 },
      { address: '::ffff:127.0.0.1', family: 6 },
      { address: '2606:4700::1111', family: 6 },
    ];
    const resolve = ((_host: string, _options: unknown, done: (err: null, all: typeof records) => void) => done(null, records)) as never;
    const guarded = publicOnly(resolve);
    const all = await new Promise((ok, fail) => guarded('mixed.example', { all: true }, ((err: Error | null, found: unknown) => (err ? fail(err) : ok(found))) as never));
    expect(all).toEqual([records[1], records[3]]);
    const one = await new Promise((ok, fail) => guarded('mixed.example', {}, (err, address, family) => (err ? fail(err) : ok([address, family]))));
    expect(one).toEqual(['93.184.216.34', 4]);
  });
});
