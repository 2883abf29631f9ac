import { describe, expect, it } from "vitest";
import { TimeSeries } from "../src/series.js";
import { sample } from "../src/stats.js";

describe("TimeSeries", () => {
  it("keeps the last five minutes in uPlot's column layout", () => {
    const series = new TimeSeries(["a", "b"]);
    for (let t = 0; t <= 400; t++) series.push(t, { a: t, b: t % 2 ? null : 1 });
    const [times, a, b] = series.data();
    expect(times[0]).toBe(100);
    expect(times.at(-1)).toBe(400);
    expect(series.length).toBe(301);
    expect(a.length).toBe(301);
    expect(b[1]).toBe(null);
  });
  it("records missing values as gaps", () => {
    const series = new TimeSeries(["a"]);
    series.push(1, {});
    expect(series.data()).toEqual([[1], [null]]);
  });
});

describe("dashboard samples", () => {
  const stats = {
    running: 2,
    waiting: 1,
    finished_requests: 5,
    prompt_tps: 100,
    generation_tps: 20,
    kv_cache: { block_size: 32, blocks_total: 10, blocks_used: 4, blocks_cached_free: 3, blocks_empty: 3, prefix_cache_hit_rate: 0.5 },
    memory: { active_bytes: 2 ** 21, peak_bytes: 2 ** 22, cache_bytes: 0, wired_limit_bytes: null },
  };
  it("come from the engine's and the system's stats, in MiB and percent", () => {
    const values = sample(stats, { ram_used_bytes: 2 ** 30, ram_total_bytes: 2 ** 32, process_rss_bytes: 2 ** 20 });
    expect(values).toMatchObject({
      mlx_active: 2, mlx_peak: 4, mlx_cache: 0, running: 2, waiting: 1, prompt_tps: 100, generation_tps: 20,
      blocks_used: 4, blocks_cached: 3, blocks_empty: 3, prefix_hit_rate: 50, ram_used: 1024, process_rss: 1,
    });
  });
  it("leave out what was not reported", () => {
    expect(sample(null, null)).toEqual({});
    expect(sample(null, { ram_used_bytes: 0, ram_total_bytes: 1, process_rss_bytes: null })).toEqual({ ram_used: 0 });
  });
});
