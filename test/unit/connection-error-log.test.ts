import { Writable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { describe, expect, it } from 'vitest';
import { createLogger } from '../../shared/logger.js';
import { ConnectionErrorLog } from '../../shared/redis.js';

/** A log whose messages are held back for `intervalMs`: short where a test waits it out, long where a slow run must not see it pass. */
function logged(intervalMs = 100): { errors: ConnectionErrorLog; records: () => Array<Record<string, any>> } {
  const lines: string[] = [];
  const sink = new Writable({ write: (chunk, _enc, done) => (lines.push(String(chunk)), done()) });
  const errors = new ConnectionErrorLog(createLogger({ level: 'info', name: 'test', destination: sink }), intervalMs);
  return { errors, records: () => lines.map((l) => JSON.parse(l) as Record<string, any>) };
}

const refused = () => Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:6390'), { code: 'ECONNREFUSED' });

describe('ConnectionErrorLog', () => {
  it('writes a repeated message once per interval, then again with how many were held back', async () => {
    const { errors, records } = logged();
    for (let n = 0; n < 5; n++) errors.report('api', refused(), 'redis connection error');
    errors.report('queue', new Error('Connection is closed.'), 'queue error');
    expect(records().map((r) => [r['source'], r['err'].message, r['err'].code, r['msg']])).toEqual([
      ['api', 'connect ECONNREFUSED 127.0.0.1:6390', 'ECONNREFUSED', 'redis connection error'],
      ['queue', 'Connection is closed.', undefined, 'queue error'],
    ]);
    await sleep(150);
    errors.report('worker', refused(), 'worker error');
    expect(records()[2]).toMatchObject({ level: 50, source: 'worker', heldBack: 4, msg: 'worker error' });
  });

  it('says when a connection is ready again, with how many were held back, and the next error is written at once', () => {
    const { errors, records } = logged(60_000);
    errors.ready('api'); // no errors before: nothing to say
    for (let n = 0; n < 3; n++) errors.report('api', refused(), 'redis connection error');
    errors.report('request', new Error('Command timed out'), 'request failed: redis unavailable', { reqId: 'r-1' });
    errors.report('request', new Error('Command timed out'), 'request failed: redis unavailable', { reqId: 'r-2' });
    errors.ready('subscriber');
    errors.report('api', refused(), 'redis connection error');
    expect(records().map((r) => r['msg'])).toEqual(['redis connection error', 'request failed: redis unavailable', 'redis connection ready again', 'redis connection error']);
    expect(records()[1]).toMatchObject({ reqId: 'r-1', source: 'request' });
    expect(records()[2]).toMatchObject({ level: 30, source: 'subscriber', heldBack: 3 });
  });

  it('remembers at most 1,000 messages: past that, the one written longest ago is written again at once', () => {
    // 1,002 log lines can take past 100 ms on a loaded machine, and "job 2" would then be written again for its interval.
    const { errors, records } = logged(60_000);
    for (let n = 0; n <= 1_000; n++) errors.report('worker', new Error(`job ${n} failed`), 'worker error');
    errors.report('worker', new Error('job 0 failed'), 'worker error'); // forgotten: written again
    errors.report('worker', new Error('job 2 failed'), 'worker error'); // remembered: held back
    expect(records()).toHaveLength(1_002);
    expect(records().at(-1)!['err'].message).toBe('job 0 failed');
  });
});
