import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { describe, expect, it } from 'vitest';

const root = resolve(import.meta.dirname, '..', '..');
const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');

describe('the keyfleet/client package', () => {
  it('exports declarations that type every option the API takes, and the types its methods take and answer by name, as a user’s tsc sees them', () => {
    const exported = JSON.parse(readFileSync(resolve(root, 'package.json'), 'utf8')).exports['./client'];
    expect(exported).toEqual({ types: './dist/client/index.d.ts', default: './dist/client/index.js' });
    // test/types/client-package.ts imports 'keyfleet/client' by the package's own name: the
    // exports above, and the declarations the build wrote (`npm test` builds first).
    const run = spawnSync(process.execPath, [tsc, '-p', resolve(root, 'test/types/tsconfig.json')], { cwd: root, encoding: 'utf8', timeout: 60_000 });
    expect(run.stdout + run.stderr).toBe('');
    expect(run.status).toBe(0);
  });
});
