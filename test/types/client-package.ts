// A user's code against the built package, as `import … from 'keyfleet/client'` resolves it
// (package.json exports and the declarations it names). test/e2e/client-types.test.ts compiles
// it with tsc: every line must type-check, and every @ts-expect-error must be an error (an
// `any` where a type should be would leave it unused, and fail too).
import {
  KeyfleetApiError,
  KeyfleetClient,
  KeyfleetTimeoutError,
  type BatchAccepted,
  type BatchOp,
  type BatchStatusBody,
  type ClientOptions,
  type CryptoAnswer,
  type CryptoOptions,
  type CryptoResponse,
  type KeyInfo,
  type KeyPolicyPatch,
  type KeyType,
  type ResultLine,
} from 'keyfleet/client';

const options: ClientOptions = { url: 'http://127.0.0.1:8080', token: 'tok_0123456789abcdef', retry: { attempts: 3 } };
const client = new KeyfleetClient(options);

export async function everyOption(): Promise<void> {
  // Item objects with a context of their own; a pinned key version; a webhook for a call that becomes a batch.
  const sealed: CryptoAnswer = await client.encrypt('pii', ['a', { plaintext: 'b', context: 'row-2' }], { keyVersion: 2, context: 'table-x' });
  if (sealed.kind === 'results') for (const r of sealed.results) if ('ciphertext' in r) r.ciphertext.toUpperCase();
  await client.decrypt('pii', ['kf:v1:AAAA', { ciphertext: 'kf:v1:AAAA', context: 'row-2' }]);
  await client.rewrap('legacy', [{ ciphertext: 'kf:v1:AAAA' }], { targetKey: 'pii' });
  const later: CryptoAnswer = await client.encrypt('pii', ['x'], { mode: 'async', callbackUrl: 'https://hooks.example/keyfleet' });
  if (later.kind === 'batch') later.batchId.toUpperCase();
  const crypto: CryptoOptions = { encoding: 'base64', keyVersion: 1, callbackUrl: 'https://hooks.example/keyfleet', idempotencyKey: 'order-1' };
  await client.encrypt('pii', ['eA=='], crypto);

  // @ts-expect-error a key version is a number
  await client.encrypt('pii', ['a'], { keyVersion: '2' });
  // @ts-expect-error decrypt takes ciphertexts, not plaintext items
  await client.decrypt('pii', [{ plaintext: 'b' }]);
  // @ts-expect-error an item object holds its text and a context, nothing else
  await client.encrypt('pii', [{ plaintext: 'b', note: 'x' }]);
  // @ts-expect-error no such option (the API would refuse it)
  await client.encrypt('pii', ['a'], { keyversion: 2 });

  const key = await client.createKey('pii');
  key.created satisfies boolean;
  key.latestVersion satisfies number;
  // @ts-expect-error a version is a number
  key.latestVersion satisfies string;
  const error = await client.getKey('missing').catch((e: unknown) => e);
  if (error instanceof KeyfleetApiError) error.code satisfies string;
}

export async function timeLimits(): Promise<void> {
  const patient = new KeyfleetClient({ ...options, timeoutMs: 5_000, idleTimeoutMs: 20_000 });
  const signal = AbortSignal.timeout(60_000);
  await patient.waitForBatch('b1', (status) => status.processed satisfies number, { signal });
  await patient.encrypt('pii', ['a'], { signal });
  await patient.createBatch({ op: 'encrypt', key: 'pii', signal }, () => ['a']);
  for await (const line of patient.results('b1', { signal })) line.i satisfies number;
  const error = await patient.rotateKey('pii').catch((e: unknown) => e);
  if (error instanceof KeyfleetTimeoutError) {
    error.call satisfies string;
    error.limitMs satisfies number;
    error.url satisfies string;
  }
  // @ts-expect-error a time limit is a number of milliseconds
  new KeyfleetClient({ ...options, timeoutMs: '30s' });
}

// The types of the methods' parameters and answers, by name: a user's own functions and fields take them.
export async function namedTypes(): Promise<void> {
  const type: KeyType = 'xchacha20-poly1305';
  const info: KeyInfo = await client.createKey('pii', type);
  info.minDecryptionVersion satisfies number;
  const patch: KeyPolicyPatch = { minDecryptionVersion: 2, deletionAllowed: true };
  (await client.patchKey('pii', patch)) satisfies KeyInfo;
  // @ts-expect-error a policy holds only the fields the API takes
  const wrong: KeyPolicyPatch = { minDecryptionVersion: 2, colour: 'red' };
  void wrong;
  const op: BatchOp = 'rewrap';
  const accepted: BatchAccepted = await client.createBatch({ op, key: 'pii', targetKey: 'pii-2' }, () => ['kf:v1:AAAA']);
  const status: BatchStatusBody = await client.waitForBatch(accepted.batchId);
  status.status satisfies 'queued' | 'running' | 'completed' | 'failed' | 'cancelled';
  const lines: ResultLine[] = [];
  for await (const line of client.results(accepted.batchId)) lines.push(line);
  const answer = await client.encrypt('pii', ['a'], { mode: 'sync' });
  if (answer.kind === 'results') answer.results satisfies CryptoResponse['results'];
  // @ts-expect-error no such operation
  const other: BatchOp = 'sign';
  void other;
}
