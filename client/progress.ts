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
  readonly #unit: Unit;
  #lastLine = 0;
  #lastTenth = -1;
  #total = -1;
  /** The line of the latest count without a total, until it is written. */
  #untotalled: string | undefined;

  /** `bytes` are shown in B, KB, MB or GB, whichever the total (or, without one, the count) reaches. */
  constructor(label: string, unit: Unit, interactive = Boolean(process.stderr.isTTY)) {
    this.#label = label;
    this.#unit = unit;
    this.#bar = interactive
      ? new cliProgress.SingleBar(
          {
            format: `${label} {bar} {percentage}% | {done}/{all} {unit} | {rate}/s | ETA {eta_formatted}`,
            stream: process.stderr,
            hideCursor: true,
            etaBuffer: 50,
            // An ETA not known yet (no rate, or none at all while a batch waits) reads `?`, not the
            // library's clipped `NULL` and `INF` ("ETA LLs").
            formatTime: (t, options, round) => (Number.isFinite(t) ? cliProgress.Format.TimeFormat(t, options, round) : '?'),
            // Drawn on every tick, changed or not: a note written over the bar's line leaves it to be drawn again below.
            forceRedraw: true,
          },
          cliProgress.Presets.shades_classic,
        )
      : undefined;
  }

  /**
   * `done` of `total`, with the rate since `startedAt` (ms since the epoch), when `doneAtStart`
   * were done. With no total (an input read from a pipe, whose size is unknown), plain lines of
   * what is done and the rate, every two seconds, even on a terminal: a bar would have no end to
   * show.
   */
  update(done: number, total: number | undefined, startedAt: number, doneAtStart = 0): void {
    const seconds = Math.max((Date.now() - startedAt) / 1000, 0.001);
    const rate = (done - doneAtStart) / seconds;
    if (total === undefined) {
      this.#untotalled = `${this.#label} ${amount(this.#unit, done)}, ${amount(this.#unit, rate)}/s\n`;
      if (Date.now() - this.#lastLine < 2_000) return;
      this.#lastLine = Date.now();
      process.stderr.write(this.#untotalled);
      this.#untotalled = undefined;
      return;
    }
    const scale = scaleOf(this.#unit, total);
    const payload = { done: inScale(scale, done), all: inScale(scale, total), unit: scale.name, rate: amount(this.#unit, rate) };
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
    process.stderr.write(`${this.#label} ${payload.done}/${payload.all} ${payload.unit} (${percent}%), ${payload.rate}/s${eta !== undefined ? `, ETA ${eta}s` : ''}\n`);
  }

  /** A message between the progress lines: on a terminal, on a line of its own above the bar, which is drawn again below it. */
  note(line: string): void {
    if (this.#bar && running.has(this)) {
      // The bar's library goes back to the cursor position it saved when it stops: saved again
      // here, that is the bar's new line, not the note's.
      process.stderr.write(`\r\x1b[K${line}\n\x1b7`);
      return;
    }
    process.stderr.write(line + '\n');
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

type Unit = 'items' | 'bytes';
interface Scale { readonly size: number; readonly name: string }

const ITEMS: Scale = { size: 1, name: 'items' };
const BYTE_SCALES: readonly Scale[] = [{ size: 1e9, name: 'GB' }, { size: 1e6, name: 'MB' }, { size: 1e3, name: 'KB' }, { size: 1, name: 'B' }];

/** Items as they are; bytes in the largest unit that `n` reaches, so a small file reads `12 B`, not `0.0 MB`. */
const scaleOf = (unit: Unit, n: number): Scale => (unit === 'items' ? ITEMS : BYTE_SCALES.find(({ size }) => n >= size) ?? BYTE_SCALES.at(-1)!);
/** Whole numbers of items or bytes; tenths of larger units. */
const inScale = ({ size }: Scale, n: number): string => (size === 1 ? Math.round(n).toLocaleString('en-US') : (n / size).toFixed(1));
const amount = (unit: Unit, n: number): string => {
  const scale = scaleOf(unit, n);
  return `${inScale(scale, n)} ${scale.name}`;
};
