/** A small HTTP client for the tests: real requests over loopback with fetch. */
export class Client {
  constructor(
    readonly base: string,
    readonly token: string,
  ) {}

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

  /** Polls a batch until it reaches a terminal status. */
  async waitForBatch(id: string, timeoutMs = 90_000): Promise<any> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const { body } = await this.json('GET', `/v1/batches/${id}`);
      if (['completed', 'failed', 'cancelled'].includes(body.status)) return body;
      if (Date.now() > deadline) throw new Error(`batch ${id} still ${body.status} after ${timeoutMs} ms (${body.processed}/${body.total})`);
      await new Promise((r) => setTimeout(r, 100));
    }
  }

  /** Downloads a batch's results and parses every NDJSON line. */
  async results(id: string, from = 0): Promise<Array<{ i: number; ciphertext?: string; plaintext?: string; error?: { code: string } }>> {
    const res = await fetch(`${this.base}/v1/batches/${id}/results${from ? `?from=${from}` : ''}`, { headers: { authorization: `Bearer ${this.token}` } });
    if (res.status !== 200) throw new Error(`results of ${id}: HTTP ${res.status} ${await res.text()}`);
    const text = await res.text();
    return text.split('\n').filter(Boolean).map((l) => JSON.parse(l));
  }
}
