import { Writable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { describe, expect, it } from 'vitest';
import { createLogger } from '../../shared/logger.js';
import { ConnectionErrorLog } from '../../shared/redis.js';

function logged(): { errors: ConnectionErrorLog; records: () => Array<Record<string, any>> } {
  const lines: string[] = [];
  const sink = new Writable({ write: (chunk, _enc, done) => (lines.push(String(chunk)), done()) });
  const errors = new ConnectionErrorLog(createLogger({ level: 'info', name: 'test', destination: sink }), 100);
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

  it('says when a connection is ready again, and the next error is written at once', () => {
    const { errors, records } = logged();
    errors.ready('api'); // no errors before: nothing to say
    errors.report('api', refused(), 'redis connection error');
    errors.ready('subscriber');
    errors.report('api', refused(), 'redis connection error');
    expect(records().map((r) => r['msg'])).toEqual(['redis connection error', 'redis connection ready again', 'redis connection error']);
    expect(records()[1]).toMatchObject({ level: 30, source: 'subscriber' });
  });
});
