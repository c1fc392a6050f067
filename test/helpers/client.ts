import { KeyfleetClient } from '../../client/index.js';
import type { ResultLine } from '../../shared/schemas.js';

/**
 * The tests' HTTP client: raw requests (status and body as sent, for the error cases) over
 * loopback, and the typed client (`typed`, the one the CLI uses) for results.
 */
export class Client {
  readonly typed: KeyfleetClient;

  constructor(
    readonly base: string,
    readonly token: string,
  ) {
    this.typed = new KeyfleetClient({ url: base, token, retry: { attempts: 1 } });
  }

  async json<T = any>(method: string, path: string, body?: unknown): Promise<{ status: number; body: T }> {
    const res = await fetch(this.base + path, {
      method,
      headers: { authorization: `Bearer ${this.token}`, ...(body === undefined ? {} : { 'content-type': 'application/json' }) },
      ...(body === undefined ? {} : { body: JSON.stringify(body) }),
    });
    const text = await res.text();
    return { status: res.status, body: (text ? JSON.parse(text) : undefined) as T };
  }

  /** Uploads items as NDJSON, one JSON string per line. */
  async uploadNdjson(op: string, key: string, lines: Iterable<string>, query = ''): Promise<{ status: number; body: any }> {
    const body = Array.from(lines, (l) => JSON.stringify(l)).join('\n') + '\n';
    const res = await fetch(`${this.base}/v1/batches?op=${op}&key=${key}${query}`, {
      method: 'POST',
      headers: { authorization: `Bearer ${this.token}`, 'content-type': 'application/x-ndjson' },
      body,
    });
    return { status: res.status, body: await res.json() };
  }

  /**
   * Polls a batch until it reaches a terminal status. The default wait lets a test wait twice
   * within vitest's 120 s test timeout, so a stuck batch fails with its status, not a bare timeout.
   */
  async waitForBatch(id: string, timeoutMs = 50_000): Promise<any> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const { body } = await this.json('GET', `/v1/batches/${id}`);
      if (['completed', 'failed', 'cancelled'].includes(body.status)) return body;
      if (Date.now() > deadline) throw new Error(`batch ${id} still ${body.status} after ${timeoutMs} ms (${body.processed}/${body.total})`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  /** Downloads a batch's results through the typed client: streamed, every line checked against the schema. */
  async results(id: string, from = 0): Promise<ResultLine[]> {
    const lines: ResultLine[] = [];
    for await (const line of this.typed.results(id, { from })) lines.push(line);
    return lines;
  }
}
