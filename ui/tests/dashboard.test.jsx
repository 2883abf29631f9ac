import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { act, fireEvent, render } from "@testing-library/preact";
import { Dashboard } from "../src/dashboard.jsx";
import { CHARTS, StatsSampler } from "../src/stats.js";
import { stubCanvas } from "./canvas.js";

const MiB = 2 ** 20;

function engineStats(overrides = {}) {
  return {
    running: 1,
    waiting: 2,
    finished_requests: 7,
    prompt_tps: 300,
    generation_tps: 40,
    kv_cache: { block_size: 32, blocks_total: 64, blocks_used: 5, blocks_cached_free: 6, blocks_empty: 53, prefix_cache_hit_rate: 0.25 },
    memory: { active_bytes: 300 * MiB, peak_bytes: 420 * MiB, cache_bytes: 12 * MiB, wired_limit_bytes: null },
    ...overrides,
  };
}

const SYSTEM = { ram_used_bytes: 2048 * MiB, ram_total_bytes: 8192 * MiB, process_rss_bytes: 512 * MiB };

/** A fake of api.js whose answers the test sets; counts calls. */
function fakeApi() {
  const api = {
    stats: engineStats(),
    system: SYSTEM,
    calls: [],
    engineStats: async () => {
      api.calls.push("engine_stats");
      if (!api.stats) throw "no model is loaded";
      return api.stats;
    },
    systemStats: async () => {
      api.calls.push("system_stats");
      return api.system;
    },
    server: { running: true, url: "http://127.0.0.1:8080/v1", requests: 2, served: 9, api_key: true, allow_lan: false },
    serverStatus: async () => {
      api.calls.push("server_status");
      return api.server;
    },
    clearCache: async () => api.calls.push("clear_cache"),
    resetPeakMemory: async () => api.calls.push("reset_peak_memory"),
  };
  return api;
}

/** The numbers list as {name: value}. */
function numbers() {
  const list = document.getElementById("stats");
  const names = [...list.querySelectorAll("dt")].map((dt) => dt.textContent);
  const values = [...list.querySelectorAll("dd")].map((dd) => dd.textContent);
  return Object.fromEntries(names.map((name, i) => [name, values[i]]));
}

const flush = () => new Promise((resolve) => setTimeout(resolve, 0));
/** A sample taken, and the dashboard drawn again with it. */
const tick = (sampler) => act(() => sampler.tick());

describe("Dashboard", () => {
  let drawn;
  beforeEach(() => {
    drawn = 0;
    stubCanvas(() => {
      drawn += 1;
    });
  });
  afterEach(() => {
    vi.restoreAllMocks();
    vi.unstubAllGlobals();
  });

  it("samples both commands into every chart's series, in MiB", async () => {
    const api = fakeApi();
    let t = 100;
    const sampler = new StatsSampler(api, () => t);
    render(<Dashboard api={api} sampler={sampler} visible={false} />);
    await tick(sampler);
    t = 101;
    api.stats = engineStats({ running: 3, memory: { ...engineStats().memory, active_bytes: 310 * MiB } });
    await tick(sampler);

    expect(sampler.samples).toBe(2);
    expect(api.calls.filter((c) => c === "engine_stats").length).toBe(2);
    const [times, active, peak, cache, rss, ram] = sampler.series.get("memory").data();
    expect(times).toEqual([100, 101]);
    expect(active).toEqual([300, 310]);
    expect(peak).toEqual([420, 420]);
    expect(cache).toEqual([12, 12]);
    expect(rss).toEqual([512, 512]);
    expect(ram).toEqual([2048, 2048]);
    expect(sampler.series.get("requests").data()).toEqual([[100, 101], [1, 3], [2, 2]]);
    expect(sampler.series.get("hit_rate").data()[1]).toEqual([25, 25]);
    // Not shown yet: nothing drawn.
    expect(document.querySelectorAll("#charts figure").length).toBe(0);
    expect(drawn).toBe(0);
  });

  it("draws one chart per graph when shown, and the numbers", async () => {
    const api = fakeApi();
    const sampler = new StatsSampler(api, () => 5);
    await sampler.tick();
    const { rerender } = render(<Dashboard api={api} sampler={sampler} visible={false} />);
    rerender(<Dashboard api={api} sampler={sampler} visible />);
    const figures = [...document.querySelectorAll("#charts figure")];
    expect(figures.map((f) => f.dataset.chart)).toEqual(CHARTS.map((c) => c.id));
    expect(drawn).toBeGreaterThan(0);
    expect(document.querySelectorAll("#charts canvas").length).toBe(CHARTS.length);
    expect(document.getElementById("charts").textContent).toContain("Decode");
    expect(numbers()).toEqual({
      Model: "loaded",
      "Metal wired limit": "not available on this machine",
      "MLX active / peak / cache": "300 MiB / 420 MiB / 12 MiB",
      "System RAM used / total": "2048 MiB / 8192 MiB",
      "Perch resident": "512 MiB",
      "KV blocks total": "64 × 32 tokens",
      "Finished requests": "7",
      "Local server": "http://127.0.0.1:8080/v1 · 2 in progress, 9 served · API key required",
    });
    // A second sample while shown redraws the same charts, not new ones.
    const canvases = [...document.querySelectorAll("#charts canvas")];
    await tick(sampler);
    expect(document.querySelectorAll("#charts figure").length).toBe(CHARTS.length);
    expect([...document.querySelectorAll("#charts canvas")]).toEqual(canvases);
    // Hidden, the graphs go; shown again, they are drawn once more from the whole window.
    rerender(<Dashboard api={api} sampler={sampler} visible={false} />);
    expect(document.querySelectorAll("#charts figure").length).toBe(0);
    rerender(<Dashboard api={api} sampler={sampler} visible />);
    expect(document.querySelectorAll("#charts figure").length).toBe(CHARTS.length);
  });

  it("keeps sampling without a model: gaps in the engine's series, the machine's numbers still shown", async () => {
    const api = fakeApi();
    api.stats = null;
    api.system = { ...SYSTEM, process_rss_bytes: null, wired_limit_bytes: undefined };
    const sampler = new StatsSampler(api, () => 9);
    render(<Dashboard api={api} sampler={sampler} visible />);
    await tick(sampler);
    const [, active, , , rss, ram] = sampler.series.get("memory").data();
    expect([active, rss, ram]).toEqual([[null], [null], [2048]]);
    const shown = numbers();
    expect(shown.Model).toBe("none loaded");
    expect(shown["MLX active / peak / cache"]).toBe("—");
    expect(shown["Perch resident"]).toBe("not reported");
    expect(shown["System RAM used / total"]).toBe("2048 MiB / 8192 MiB");
  });

  it("says when the model was unloaded while idle and how far it has loaded again", async () => {
    const api = fakeApi();
    const sampler = new StatsSampler(api, () => 1);
    render(<Dashboard api={api} sampler={sampler} visible={false} />);
    api.stats = engineStats({ residency: { state: "unloaded" } });
    await tick(sampler);
    expect(numbers().Model).toBe("unloaded while idle; the next message loads it again");
    api.stats = engineStats({ residency: { state: "loading", bytes_read: 30, bytes_total: 120 } });
    await tick(sampler);
    expect(numbers().Model).toBe("loading again… 25%");
    api.stats = engineStats({ residency: { state: "loading", bytes_read: 0, bytes_total: 0 } });
    await tick(sampler);
    expect(numbers().Model).toBe("loading again…");
    api.stats = engineStats({ residency: { state: "loaded" } });
    await tick(sampler);
    expect(numbers().Model).toBe("loaded");
  });

  it("shows the local server off, on other devices, and without a key", async () => {
    const api = fakeApi();
    const sampler = new StatsSampler(api, () => 1);
    render(<Dashboard api={api} sampler={sampler} visible={false} />);
    api.server = { running: false, url: null, requests: 0, served: 0, api_key: false, allow_lan: false };
    await tick(sampler);
    expect(numbers()["Local server"]).toBe("off (Settings → Local server)");
    api.server = { running: true, url: "http://0.0.0.0:1234/v1", requests: 0, served: 0, api_key: false, allow_lan: true };
    await tick(sampler);
    expect(numbers()["Local server"]).toBe("http://0.0.0.0:1234/v1 · 0 in progress, 0 served · open to other devices on the network");
  });

  it("shows the Metal wired limit where the engine reports one", async () => {
    const api = fakeApi();
    api.stats = engineStats({ memory: { ...engineStats().memory, wired_limit_bytes: 6144 * MiB } });
    const sampler = new StatsSampler(api, () => 1);
    render(<Dashboard api={api} sampler={sampler} visible={false} />);
    await tick(sampler);
    expect(numbers()["Metal wired limit"]).toBe("6144 MiB");
  });

  it("frees the MLX cache and resets the peak, then samples again at once", async () => {
    const api = fakeApi();
    const sampler = new StatsSampler(api, () => 1);
    render(<Dashboard api={api} sampler={sampler} visible={false} />);
    fireEvent.click(document.getElementById("clear-cache"));
    await flush();
    await flush();
    expect(api.calls).toEqual(["clear_cache", "engine_stats", "system_stats", "server_status"]);
    fireEvent.click(document.getElementById("reset-peak"));
    await flush();
    await flush();
    expect(api.calls.slice(4)).toEqual(["reset_peak_memory", "engine_stats", "system_stats", "server_status"]);
    expect(sampler.samples).toBe(2);
  });

  it("graphs each client's prefix-cache hit rate and lists its last misses", async () => {
    vi.useFakeTimers({ toFake: ["Date"] });
    vi.setSystemTime(1_800_000_000_000);
    const agent = "claude-cli/2.0 (key 3fa2c1d0)";
    const miss = {
      at_unix_ms: 1_800_000_000_000 - 12_000,
      prompt_tokens: 1000,
      cached_tokens: 512,
      miss: { reason: "diverged", at_token: 530 },
      description: "the prompt differs from this client's previous one at token 530",
    };
    const clients = [
      { client: agent, requests: 3, prompt_tokens: 3000, cached_tokens: 2400, last_misses: [miss] },
      { client: "Perch chat", requests: 1, prompt_tokens: 40, cached_tokens: 0, last_misses: [] },
    ];
    const api = fakeApi();
    api.stats = engineStats({ clients });
    let t = 10;
    const sampler = new StatsSampler(api, () => t);
    await sampler.tick();
    t = 11;
    api.stats = engineStats({ clients: [{ ...clients[0], requests: 4, prompt_tokens: 4000, cached_tokens: 3600 }, clients[1]] });
    await sampler.tick();
    expect(sampler.clients.get(agent).data()).toEqual([[10, 11], [80, 90]]);
    expect(sampler.clients.get("Perch chat").data()[1]).toEqual([0, 0]);
    render(<Dashboard api={api} sampler={sampler} visible />);
    const shown = [...document.querySelectorAll("#clients .client")];
    expect(shown.map((c) => c.dataset.client)).toEqual([agent, "Perch chat"]);
    expect(document.querySelectorAll("#clients figure").length).toBe(2);
    expect(shown[0].textContent).toContain("4 requests, 90% of 4000 prompt tokens from the cache");
    expect(shown[0].querySelector(".misses").textContent).toBe(
      "12 s ago: 512 of 1000 tokens cached; the prompt differs from this client's previous one at token 530",
    );
    expect(shown[1].querySelector(".misses")).toBeNull();
    // A client the engine no longer lists loses its graph.
    t = 12;
    api.stats = engineStats({ clients: [clients[1]] });
    await sampler.tick();
    expect([...sampler.clients.keys()]).toEqual(["Perch chat"]);
    vi.useRealTimers();
  });

  it("samples once a second from start, and stops", async () => {
    vi.useFakeTimers();
    try {
      const api = fakeApi();
      const sampler = new StatsSampler(api, () => 1);
      sampler.start();
      await vi.advanceTimersByTimeAsync(3000);
      expect(sampler.samples).toBe(4);
      sampler.stop();
      await vi.advanceTimersByTimeAsync(3000);
      expect(sampler.samples).toBe(4);
    } finally {
      vi.useRealTimers();
    }
  });
});
