import cliProgress from 'cli-progress';

/**
 * Shows progress on stderr: a bar with rate and ETA on a terminal, plain lines elsewhere (every
 * two seconds or every 10%, and at the end), so logs of scripted runs stay readable. Without a
 * total (an input from a pipe) there is no bar: lines of what is done, every two seconds and
 * at the end.
 */
export class Progress {
  readonly #bar: cliProgress.SingleBar | undefined;
  readonly #label: string;
  readonly #unit: string;
  readonly #format: (n: number) => string;
  #lastLine = 0;
  #lastTenth = -1;
  #total = -1;
  /** The line of the latest count without a total, until it is written. */
  #untotalled: string | undefined;

  constructor(label: string, unit: 'items' | 'MB', interactive = Boolean(process.stderr.isTTY)) {
    this.#label = label;
    this.#unit = unit;
    this.#format = unit === 'MB' ? (n) => (n / 1e6).toFixed(1) : (n) => Math.round(n).toLocaleString('en-US');
    this.#bar = interactive
      ? new cliProgress.SingleBar(
          {
            format: `${label} {bar} {percentage}% | {done}/{all} ${unit} | {rate} ${unit}/s | ETA {eta_formatted}`,
            stream: process.stderr,
            hideCursor: true,
            etaBuffer: 50,
          },
          cliProgress.Presets.shades_classic,
        )
      : undefined;
  }

  /**
   * `done` of `total`, with the rate since `startedAt` (ms since the epoch). With no total (an
   * input read from a pipe, whose size is unknown), plain lines of what is done and the rate,
   * every two seconds, even on a terminal: a bar would have no end to show.
   */
  update(done: number, total: number | undefined, startedAt: number): void {
    const seconds = Math.max((Date.now() - startedAt) / 1000, 0.001);
    const rate = done / seconds;
    if (total === undefined) {
      this.#untotalled = `${this.#label} ${this.#format(done)} ${this.#unit}, ${this.#format(rate)} ${this.#unit}/s\n`;
      if (Date.now() - this.#lastLine < 2_000) return;
      this.#lastLine = Date.now();
      process.stderr.write(this.#untotalled);
      this.#untotalled = undefined;
      return;
    }
    const payload = { done: this.#format(done), all: this.#format(total), rate: this.#format(rate) };
    if (this.#bar) {
      if (total !== this.#total) {
        this.#bar.start(total, done, payload);
        running.add(this);
      }
      this.#total = total;
      this.#bar.update(done, payload);
      return;
    }
    const tenth = total ? Math.floor((done / total) * 10) : 0;
    const now = Date.now();
    if (now - this.#lastLine < 2_000 && tenth === this.#lastTenth && done < total) return;
    this.#lastLine = now;
    this.#lastTenth = tenth;
    const eta = rate > 0 ? Math.ceil((total - done) / rate) : undefined;
    const percent = total ? Math.floor((done / total) * 100) : 0;
    process.stderr.write(`${this.#label} ${payload.done}/${payload.all} ${this.#unit} (${percent}%), ${payload.rate} ${this.#unit}/s${eta !== undefined ? `, ETA ${eta}s` : ''}\n`);
  }

  stop(): void {
    this.#bar?.stop();
    running.delete(this);
    // The last figures of a count without a total, if they came after its last line.
    if (this.#untotalled) process.stderr.write(this.#untotalled);
    this.#untotalled = undefined;
  }

  /** Stops every bar (each gives the terminal its cursor back): before the CLI exits on a signal. */
  static stopAll(): void {
    for (const bar of [...running]) bar.stop();
  }
}

const running = new Set<Progress>();
