import { existsSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';

/** The project root: the nearest folder above this file holding binding.gyp (true for the sources and for dist/). */
export function projectRoot(): string | undefined {
  for (let dir = import.meta.dirname; ; dir = dirname(dir)) {
    if (existsSync(join(dir, 'binding.gyp'))) return dir;
    if (dirname(dir) === dir) return undefined;
  }
}

/** keyfleet's version, from its package.json. */
export function projectVersion(): string {
  const root = projectRoot();
  return root ? (JSON.parse(readFileSync(join(root, 'package.json'), 'utf8')) as { version: string }).version : '0.0.0';
}
