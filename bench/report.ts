export interface Row {
  readonly section: string;
  readonly name: string;
  readonly value: number;
  readonly unit: string;
  /** The figure this one is compared with, measured in the same run. */
  readonly reference?: number;
  readonly ratio?: number;
  readonly note?: string;
}

/** The middle value (the mean of the middle two for an even count). */
export function median(values: readonly number[]): number {
  const sorted = [...values].sort((a, b) => a - b);
  const mid = Math.floor(sorted.length / 2);
  return sorted.length % 2 ? sorted[mid]! : (sorted[mid - 1]! + sorted[mid]!) / 2;
}

const fmt = (v: number): string => (v >= 100 ? Math.round(v).toLocaleString('en-US') : v.toFixed(v >= 10 ? 1 : 2));

export function printTable(rows: readonly Row[]): string {
  const lines = ['| section | measurement | value | unit | reference | ratio |', '| --- | --- | ---: | --- | ---: | ---: |'];
  for (const r of rows) {
    lines.push(`| ${r.section} | ${r.name}${r.note ? ` (${r.note})` : ''} | ${fmt(r.value)} | ${r.unit} | ${r.reference === undefined ? '' : fmt(r.reference)} | ${r.ratio === undefined ? '' : `${r.ratio.toFixed(2)}×`} |`);
  }
  return lines.join('\n');
}
