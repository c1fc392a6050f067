import { Redis } from 'ioredis';
import { randomBytes } from 'node:crypto';
import { connect } from 'node:net';
import { Writable } from 'node:stream';
import { describe, expect, inject, it } from 'vitest';
import { createLogger } from '../../shared/logger.js';

// What a log line shows of an error (shared/logger.ts errorForLog), with real errors: one from
// Redis, one from a refused connection, one from Node's URL parser.
describe('errors in log lines', () => {
  const lineOf = (err: unknown): Record<string, any> => {
    const lines: string[] = [];
    const sink = new Writable({ write: (chunk, _enc, done) => (lines.push(String(chunk)), done()) });
    createLogger({ level: 'info', name: 'test', destination: sink }).error({ err }, 'failed');
    return JSON.parse(lines[0]!) as Record<string, any>;
  };

  it('show a refused Redis command by its name, never its arguments, and a discarded transaction with the errors that made it', async () => {
    const redis = new Redis(inject('redisUrl'));
    const secret = `sealed-${randomBytes(8).toString('hex')}`;
    try {
      const err = await redis.set(`kft-log-${secret}`, Buffer.from(secret), 'EX', 'not-a-number' as unknown as number).catch((e: unknown) => e);
      expect((err as { command?: { args?: unknown[] } }).command?.args).toHaveLength(4); // pino's own serializer wrote these out
      const { err: shown } = lineOf(err);
      expect(shown).toMatchObject({ type: 'ReplyError', command: 'set', message: expect.stringMatching(/^ERR /), stack: expect.any(String) });
      expect(JSON.stringify(shown)).not.toContain(secret);
      // A transaction Redis discarded: the error of the command that made it, the same way.
      const discarded = await redis.multi().call('set', `kft-log-${secret}`).exec().catch((e: unknown) => e);
      expect(lineOf(discarded).err).toMatchObject({ message: expect.stringMatching(/^EXECABORT/), command: 'exec', previousErrors: [{ type: 'ReplyError', command: 'set', message: expect.stringContaining('wrong number of arguments') }] });
      expect(JSON.stringify(lineOf(discarded))).not.toContain(secret);
    } finally {
      redis.disconnect();
    }
  });

  it('keep where a system call failed, causes and aggregated errors, and drop other properties (a URL with its password)', async () => {
    const password = `pw${randomBytes(8).toString('hex')}`;
    let invalid: unknown;
    try {
      new URL(`redis://:${password}@[::1`);
    } catch (err) {
      invalid = err;
    }
    expect(JSON.stringify(invalid)).toContain(password); // Node keeps the input on the error
    const refused = await new Promise<Error>((resolve) => connect(1, '127.0.0.1').once('error', resolve));
    const wrapped = new AggregateError([refused, new Error('outer', { cause: invalid })], 'all failed');
    const { err: shown } = lineOf(wrapped);
    expect(shown).toMatchObject({
      type: 'AggregateError',
      message: 'all failed',
      errors: [{ code: 'ECONNREFUSED', syscall: 'connect', address: '127.0.0.1', port: 1 }, { message: 'outer', cause: { type: 'TypeError', code: 'ERR_INVALID_URL' } }],
    });
    expect(JSON.stringify(shown)).not.toContain(password);
  });
});
