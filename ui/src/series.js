// A sliding window of samples for the dashboard's graphs, in the column layout uPlot draws:
// [[t0, t1, ...], [a0, a1, ...], [b0, b1, ...]], times in seconds.

export class TimeSeries {
  /** `names`: one per series (besides time); `windowSeconds`: how far back to keep. */
  constructor(names, windowSeconds = 300) {
    this.names = names;
    this.windowSeconds = windowSeconds;
    this.columns = [[], ...names.map(() => [])];
  }

  /**
   * Adds a sample at `t` (seconds) with `values` keyed by series name (missing ones are null,
   * drawn as gaps), and drops samples older than the window.
   */
  push(t, values) {
    this.columns[0].push(t);
    this.names.forEach((name, i) => this.columns[i + 1].push(values[name] ?? null));
    const oldest = t - this.windowSeconds;
    let drop = 0;
    while (drop < this.columns[0].length && this.columns[0][drop] < oldest) drop++;
    if (drop > 0) for (const column of this.columns) column.splice(0, drop);
  }

  /** The columns (shared, not copied: uPlot reads them as they are). */
  data() {
    return this.columns;
  }

  get length() {
    return this.columns[0].length;
  }
}
