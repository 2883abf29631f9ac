// The dashboard's numbers: the engine's stats and the machine's memory sampled once a second
// (whether or not the dashboard is shown) into the graphs' series, over the last five minutes,
// and each client's prefix-cache hit rate (the app's chat, each API client) into one of its own.
// Every number comes from the `engine_stats`, `system_stats` and `server_status` commands.

import { TimeSeries } from "./series.js";

const MiB = 2 ** 20;

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

/**
 * A client's share of prompt tokens read from the prefix cache, in percent, from its tally
 * (perch-sched's `ClientTally`); null before any prompt.
 */
export function clientHitRate(tally) {
  return tally.prompt_tokens > 0 ? (100 * tally.cached_tokens) / tally.prompt_tokens : null;
}

/** The graph of one client's hit rate (a chart as CHARTS has them). */
export function clientChart(client) {
  return { id: "client-hit-rate", title: `${client}: prefix-cache hit rate (%)`, series: [["hit_rate", "Hit rate"]] };
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

/** Samples the three commands into one TimeSeries per graph; subscribers hear of each sample. */
export class StatsSampler {
  /** `api`: src/api.js; `now()`: the time in seconds. */
  constructor(api, now = () => Date.now() / 1000) {
    this.api = api;
    this.now = now;
    this.series = new Map(CHARTS.map((c) => [c.id, new TimeSeries(c.series.map(([key]) => key))]));
    /** Each client's hit-rate series, for the clients the engine's last stats list. */
    this.clients = new Map();
    this.samples = 0;
    /** The last answers: EngineStats, SystemStats and the server's status (each null when it failed). */
    this.last = { stats: null, system: null, server: null };
    this.listeners = new Set();
  }

  /** Calls `listener()` after each sample; returns the function that stops it. */
  subscribe(listener) {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  }

  async tick() {
    const [stats, system, server] = await Promise.all([
      this.api.engineStats().catch(() => null),
      this.api.systemStats().catch(() => null),
      this.api.serverStatus().catch(() => null),
    ]);
    const values = sample(stats, system);
    const t = this.now();
    for (const series of this.series.values()) series.push(t, values);
    const tallies = stats?.clients ?? [];
    for (const tally of tallies) {
      if (!this.clients.has(tally.client)) this.clients.set(tally.client, new TimeSeries(["hit_rate"]));
      this.clients.get(tally.client).push(t, { hit_rate: clientHitRate(tally) });
    }
    const listed = new Set(tallies.map((tally) => tally.client));
    for (const client of this.clients.keys()) if (stats && !listed.has(client)) this.clients.delete(client);
    this.samples += 1;
    this.last = { stats, system, server };
    for (const listener of this.listeners) listener();
  }

  /** Starts sampling every `periodMs` (1 s). */
  start(periodMs = 1000) {
    this.tick();
    this.timer = setInterval(() => this.tick(), periodMs);
  }

  stop() {
    clearInterval(this.timer);
  }
}
