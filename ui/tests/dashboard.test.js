import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { CHARTS, Dashboard } from "../src/dashboard.js";
import { loadPage } from "./page.js";

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

describe("Dashboard", () => {
  let drawn;
  beforeEach(() => {
    loadPage();
    // jsdom has no 2D canvas: uPlot gets a context and paths whose every method does nothing.
    drawn = 0;
    const noop = (target) => new Proxy(target, { get: (t, key) => (key in t ? t[key] : () => ({ width: 0 })) });
    const context = noop({});
    vi.stubGlobal("Path2D", function Path2D() { return noop({}); });
    vi.spyOn(HTMLCanvasElement.prototype, "getContext").mockImplementation(() => {
      drawn += 1;
      return context;
    });
  });
  afterEach(() => {
    vi.restoreAllMocks();
    vi.unstubAllGlobals();
  });

  it("samples both commands into every chart's series, in MiB", async () => {
    const api = fakeApi();
    let t = 100;
    const dashboard = new Dashboard(document.getElementById("view-dashboard"), api, () => t);
    await dashboard.tick();
    t = 101;
    api.stats = engineStats({ running: 3, memory: { ...engineStats().memory, active_bytes: 310 * MiB } });
    await dashboard.tick();

    expect(dashboard.samples).toBe(2);
    expect(api.calls.filter((c) => c === "engine_stats").length).toBe(2);
    const [times, active, peak, cache, rss, ram] = dashboard.series.get("memory").data();
    expect(times).toEqual([100, 101]);
    expect(active).toEqual([300, 310]);
    expect(peak).toEqual([420, 420]);
    expect(cache).toEqual([12, 12]);
    expect(rss).toEqual([512, 512]);
    expect(ram).toEqual([2048, 2048]);
    expect(dashboard.series.get("requests").data()).toEqual([[100, 101], [1, 3], [2, 2]]);
    expect(dashboard.series.get("hit_rate").data()[1]).toEqual([25, 25]);
    // Not shown yet: nothing drawn.
    expect(document.querySelectorAll("#charts figure").length).toBe(0);
  });

  it("draws one chart per graph when shown, and the numbers", async () => {
    const api = fakeApi();
    const dashboard = new Dashboard(document.getElementById("view-dashboard"), api, () => 5);
    await dashboard.tick();
    dashboard.setVisible(true);
    const figures = [...document.querySelectorAll("#charts figure")];
    expect(figures.map((f) => f.dataset.chart)).toEqual(CHARTS.map((c) => c.id));
    expect(drawn).toBeGreaterThan(0);
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
    await dashboard.tick();
    expect(document.querySelectorAll("#charts figure").length).toBe(CHARTS.length);
  });

  it("keeps sampling without a model: gaps in the engine's series, the machine's numbers still shown", async () => {
    const api = fakeApi();
    api.stats = null;
    api.system = { ...SYSTEM, process_rss_bytes: null, wired_limit_bytes: undefined };
    const dashboard = new Dashboard(document.getElementById("view-dashboard"), api, () => 9);
    dashboard.setVisible(true);
    await dashboard.tick();
    const [, active, , , rss, ram] = dashboard.series.get("memory").data();
    expect([active, rss, ram]).toEqual([[null], [null], [2048]]);
    const shown = numbers();
    expect(shown.Model).toBe("none loaded");
    expect(shown["MLX active / peak / cache"]).toBe("—");
    expect(shown["Perch resident"]).toBe("not reported");
    expect(shown["System RAM used / total"]).toBe("2048 MiB / 8192 MiB");
  });

  it("shows the local server off, on other devices, and without a key", async () => {
    const api = fakeApi();
    const dashboard = new Dashboard(document.getElementById("view-dashboard"), api, () => 1);
    api.server = { running: false, url: null, requests: 0, served: 0, api_key: false, allow_lan: false };
    await dashboard.tick();
    dashboard.drawNumbers();
    expect(numbers()["Local server"]).toBe("off (Settings → Local server)");
    api.server = { running: true, url: "http://0.0.0.0:1234/v1", requests: 0, served: 0, api_key: false, allow_lan: true };
    await dashboard.tick();
    dashboard.drawNumbers();
    expect(numbers()["Local server"]).toBe("http://0.0.0.0:1234/v1 · 0 in progress, 0 served · open to other devices on the network");
  });

  it("shows the Metal wired limit where the engine reports one", async () => {
    const api = fakeApi();
    api.stats = engineStats({ memory: { ...engineStats().memory, wired_limit_bytes: 6144 * MiB } });
    const dashboard = new Dashboard(document.getElementById("view-dashboard"), api, () => 1);
    await dashboard.tick();
    dashboard.drawNumbers();
    expect(numbers()["Metal wired limit"]).toBe("6144 MiB");
  });

  it("frees the MLX cache and resets the peak, then samples again at once", async () => {
    const api = fakeApi();
    const dashboard = new Dashboard(document.getElementById("view-dashboard"), api, () => 1);
    document.getElementById("clear-cache").click();
    await flush();
    await flush();
    expect(api.calls).toEqual(["clear_cache", "engine_stats", "system_stats", "server_status"]);
    document.getElementById("reset-peak").click();
    await flush();
    await flush();
    expect(api.calls.slice(4)).toEqual(["reset_peak_memory", "engine_stats", "system_stats", "server_status"]);
    expect(dashboard.samples).toBe(2);
  });

  it("samples once a second from start", async () => {
    vi.useFakeTimers();
    try {
      const api = fakeApi();
      const dashboard = new Dashboard(document.getElementById("view-dashboard"), api, () => 1);
      dashboard.start();
      await vi.advanceTimersByTimeAsync(3000);
      expect(dashboard.samples).toBe(4);
      clearInterval(dashboard.timer);
    } finally {
      vi.useRealTimers();
    }
  });
});
