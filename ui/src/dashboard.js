// The dashboard: live graphs (uPlot) of the engine's stats and the machine's memory, sampled
// once a second whether or not the view is shown, over the last five minutes. Every number
// comes from the `engine_stats`, `system_stats` and `server_status` commands.

import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import { TimeSeries } from "./series.js";
import { mib } from "./format.js";

const MiB = 2 ** 20;
const COLORS = ["#3b82f6", "#ef4444", "#10b981", "#f59e0b", "#8b5cf6"];

/** The graphs: id, title, and [sample key, legend label] per line. */
export const CHARTS = [
  {
    id: "memory",
    title: "Memory (MiB)",
    series: [
      ["mlx_active", "MLX active"],
      ["mlx_peak", "MLX peak"],
      ["mlx_cache", "MLX cache"],
      ["process_rss", "Perch resident"],
      ["ram_used", "System RAM used"],
    ],
  },
  { id: "throughput", title: "Throughput (tok/s)", series: [["prompt_tps", "Prefill"], ["generation_tps", "Decode"]] },
  { id: "requests", title: "Requests", series: [["running", "Running"], ["waiting", "Waiting"]] },
  {
    id: "blocks",
    title: "KV cache blocks",
    series: [["blocks_used", "Used"], ["blocks_cached", "Cached (free)"], ["blocks_empty", "Empty"]],
  },
  { id: "hit_rate", title: "Prefix-cache hit rate (%)", series: [["prefix_hit_rate", "Hit rate"]] },
];

/**
 * One sample from the commands' answers: `stats` is EngineStats or null (no model), `system`
 * is SystemStats or null. Memory in MiB, rates in tok/s, hit rate in percent.
 */
export function sample(stats, system) {
  const values = {};
  if (stats) {
    Object.assign(values, {
      mlx_active: stats.memory.active_bytes / MiB,
      mlx_peak: stats.memory.peak_bytes / MiB,
      mlx_cache: stats.memory.cache_bytes / MiB,
      prompt_tps: stats.prompt_tps,
      generation_tps: stats.generation_tps,
      running: stats.running,
      waiting: stats.waiting,
      blocks_used: stats.kv_cache.blocks_used,
      blocks_cached: stats.kv_cache.blocks_cached_free,
      blocks_empty: stats.kv_cache.blocks_empty,
      prefix_hit_rate: stats.kv_cache.prefix_cache_hit_rate * 100,
    });
  }
  if (system) {
    values.ram_used = system.ram_used_bytes / MiB;
    if (system.process_rss_bytes != null) values.process_rss = system.process_rss_bytes / MiB;
  }
  return values;
}

/** The local server's line: its address and live requests, or how to turn it on. */
export function serverLine(status) {
  if (!status) return "—";
  if (!status.running) return "off (Settings → Local server)";
  const parts = [status.url, `${status.requests} in progress, ${status.served} served`];
  if (status.allow_lan) parts.push("open to other devices on the network");
  if (status.api_key) parts.push("API key required");
  return parts.join(" · ");
}

export class Dashboard {
  /** `root`: the dashboard view's element; `api`: src/api.js. */
  constructor(root, api, now = () => Date.now() / 1000) {
    this.root = root;
    this.api = api;
    this.now = now;
    this.series = new Map(CHARTS.map((c) => [c.id, new TimeSeries(c.series.map(([key]) => key))]));
    this.plots = new Map();
    this.visible = false;
    this.samples = 0;
    root.querySelector("#clear-cache").addEventListener("click", () => this.api.clearCache().then(() => this.tick()));
    root.querySelector("#reset-peak").addEventListener("click", () => this.api.resetPeakMemory().then(() => this.tick()));
    // The axes are drawn in the design tokens' colours: a change of scheme rebuilds the charts.
    root.ownerDocument.defaultView?.matchMedia?.("(prefers-color-scheme: dark)")?.addEventListener?.("change", () => this.rebuild());
  }

  /** Drops the charts; the next draw makes them again (in the current colours). */
  rebuild() {
    for (const plot of this.plots.values()) {
      plot.root.closest("figure")?.remove();
      plot.destroy();
    }
    this.plots.clear();
    if (this.visible) this.draw();
  }

  /** uPlot's axes in the tokens' colours (canvas text does not inherit CSS). */
  axisColours() {
    const doc = this.root.ownerDocument;
    const css = doc.defaultView?.getComputedStyle?.(doc.documentElement);
    const token = (name, fallback) => css?.getPropertyValue(name)?.trim() || fallback;
    const text = token("--text-muted", "#545c69");
    const line = token("--border", "#d5d9e0");
    return { stroke: text, grid: { stroke: line, width: 1 }, ticks: { stroke: line, width: 1 } };
  }

  /** Starts sampling every `periodMs` (1 s). */
  start(periodMs = 1000) {
    this.tick();
    this.timer = setInterval(() => this.tick(), periodMs);
  }

  setVisible(visible) {
    this.visible = visible;
    if (visible) this.draw();
  }

  async tick() {
    const [stats, system, server] = await Promise.all([
      this.api.engineStats().catch(() => null),
      this.api.systemStats().catch(() => null),
      this.api.serverStatus().catch(() => null),
    ]);
    this.lastServer = server;
    const values = sample(stats, system);
    const t = this.now();
    for (const [id, series] of this.series) series.push(t, values);
    this.samples += 1;
    this.lastStats = stats;
    this.lastSystem = system;
    if (this.visible) this.draw();
  }

  draw() {
    const doc = this.root.ownerDocument;
    const width = Math.max(280, (this.root.clientWidth || 400) - 24);
    for (const chart of CHARTS) {
      const data = this.series.get(chart.id).data();
      let plot = this.plots.get(chart.id);
      if (!plot) {
        const holder = doc.createElement("figure");
        holder.className = "chart";
        holder.dataset.chart = chart.id;
        this.root.querySelector("#charts").append(holder);
        plot = new uPlot(
          {
            title: chart.title,
            width,
            height: 140,
            scales: { x: { time: true } },
            series: [{}, ...chart.series.map(([, label], i) => ({ label, stroke: COLORS[i], width: 1.5, points: { show: false } }))],
            legend: { live: false },
            axes: [{ ...this.axisColours() }, { ...this.axisColours(), size: 50 }],
          },
          data,
          holder,
        );
        this.plots.set(chart.id, plot);
      } else {
        if (plot.width !== width) plot.setSize({ width, height: 140 });
        plot.setData(data);
      }
    }
    this.drawNumbers();
  }

  drawNumbers() {
    const stats = this.lastStats;
    const system = this.lastSystem;
    const rows = [
      ["Model", stats ? "loaded" : "none loaded"],
      ["Metal wired limit", stats?.memory.wired_limit_bytes != null ? mib(stats.memory.wired_limit_bytes) : "not available on this machine"],
      ["MLX active / peak / cache", stats ? [stats.memory.active_bytes, stats.memory.peak_bytes, stats.memory.cache_bytes].map(mib).join(" / ") : "—"],
      ["System RAM used / total", system ? `${mib(system.ram_used_bytes)} / ${mib(system.ram_total_bytes)}` : "—"],
      ["Perch resident", system?.process_rss_bytes != null ? mib(system.process_rss_bytes) : "not reported"],
      ["KV blocks total", stats ? `${stats.kv_cache.blocks_total} × ${stats.kv_cache.block_size} tokens` : "—"],
      ["Finished requests", stats ? String(stats.finished_requests) : "—"],
      ["Local server", serverLine(this.lastServer)],
    ];
    const list = this.root.querySelector("#stats");
    list.replaceChildren();
    const doc = this.root.ownerDocument;
    for (const [name, value] of rows) {
      const dt = doc.createElement("dt");
      dt.textContent = name;
      const dd = doc.createElement("dd");
      dd.textContent = value;
      list.append(dt, dd);
    }
  }
}
