import { spawn, type ChildProcess } from 'node:child_process';
import { resolve } from 'node:path';

const cliPath = resolve(import.meta.dirname, '..', '..', 'dist', 'client', 'cli.js');

export interface CliRun {
  readonly code: number | null;
  readonly stdout: string;
  readonly stderr: string;
}

/**
 * Runs the built CLI as a user would, in `cwd` with only PATH and `env`; resolves with its exit
 * status and output once both are read to the end. A run past `timeoutMs` is killed. `started`
 * gets the process, to signal it. `stdin`: text or bytes written to its stdin (a pipe, which Node makes a
 * socket), or an open file's descriptor as its stdin (`< file`); by default a pipe left open.
 */
export function runCli(args: readonly string[], { cwd, env, timeoutMs = 90_000, started, stdin }: { cwd: string; env: Record<string, string>; timeoutMs?: number; started?: (child: ChildProcess) => void; stdin?: string | Buffer | { fd: number } }): Promise<CliRun> {
  return new Promise((done, fail) => {
    const child = spawn(process.execPath, [cliPath, ...args], { env: { PATH: process.env['PATH'] ?? '', ...env }, cwd, stdio: [typeof stdin === 'object' && !Buffer.isBuffer(stdin) ? stdin.fd : 'pipe', 'pipe', 'pipe'] });
    if (typeof stdin === 'string' || Buffer.isBuffer(stdin)) {
      child.stdin!.on('error', () => {}); // EPIPE when the CLI ends without reading it all: its own outcome tells
      child.stdin!.end(stdin);
    }
    started?.(child);
    let stdout = '';
    let stderr = '';
    child.stdout!.on('data', (d) => (stdout += d));
    child.stderr!.on('data', (d) => (stderr += d));
    const timer = setTimeout(() => child.kill('SIGKILL'), timeoutMs);
    child.on('error', fail);
    // 'close', not 'exit': it comes once stdout and stderr are read to the end.
    child.on('close', (code) => (clearTimeout(timer), done({ code, stdout, stderr })));
  });
}
