// The dashboard: live graphs (uPlot, src/chart.jsx) of the sampler's series (src/stats.js) and
// the latest numbers. The graphs are drawn while the view is shown; their axes are in the design
// tokens' colours, and a change of colour scheme draws them again.

import { useEffect, useLayoutEffect, useReducer, useRef } from "preact/hooks";
import { Chart } from "./chart.jsx";
import { mib } from "./format.js";
import { CHARTS, clientChart, clientHitRate, serverLine } from "./stats.js";

/** uPlot's axes in the tokens' colours (canvas text does not inherit CSS). */
function axisColours() {
  const css = globalThis.getComputedStyle?.(document.documentElement);
  const token = (name, fallback) => css?.getPropertyValue(name)?.trim() || fallback;
  const text = token("--text-muted", "#545c69");
  const line = token("--border", "#d5d9e0");
  return { stroke: text, grid: { stroke: line, width: 1 }, ticks: { stroke: line, width: 1 } };
}

/**
 * Whether the engine's model is in memory, from its stats' `residency` (perch-engine's
 * `Residency`): unloaded after the idle time in Settings, loading again for a request.
 */
export function residencyLine(stats) {
  if (!stats) return "none loaded";
  const residency = stats.residency ?? { state: "loaded" };
  if (residency.state === "unloaded") return "unloaded while idle; the next message loads it again";
  if (residency.state === "loading") {
    const { bytes_read: read, bytes_total: total } = residency;
    return total > 0 ? `loading again… ${Math.floor((100 * Math.min(read, total)) / total)}%` : "loading again…";
  }
  return "loaded";
}

/** The numbers under the graphs, [name, value], from the last sample. */
export function numbers({ stats, system, server }) {
  return [
    ["Model", residencyLine(stats)],
    ["Metal wired limit", stats?.memory.wired_limit_bytes != null ? mib(stats.memory.wired_limit_bytes) : "not available on this machine"],
    ["MLX active / peak / cache", stats ? [stats.memory.active_bytes, stats.memory.peak_bytes, stats.memory.cache_bytes].map(mib).join(" / ") : "—"],
    ["System RAM used / total", system ? `${mib(system.ram_used_bytes)} / ${mib(system.ram_total_bytes)}` : "—"],
    ["Perch resident", system?.process_rss_bytes != null ? mib(system.process_rss_bytes) : "not reported"],
    ["KV blocks total", stats ? `${stats.kv_cache.blocks_total} × ${stats.kv_cache.block_size} tokens` : "—"],
    ["Finished requests", stats ? String(stats.finished_requests) : "—"],
    ["Local server", serverLine(server)],
  ];
}

/** How long ago `unixMs` was, briefly ("12 s ago", "3 min ago"), from `nowMs`. */
export function ago(unixMs, nowMs = Date.now()) {
  const seconds = Math.max(0, Math.round((nowMs - unixMs) / 1000));
  if (seconds < 60) return `${seconds} s ago`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ago`;
  return `${Math.floor(seconds / 3600)} h ago`;
}

/**
 * Each client's prefix-cache hit rate over time and its last misses (the engine's
 * `EngineStats.clients`, most recently seen first): what an agent's user reads when its
 * prompts are computed again.
 */
function Clients({ sampler, visible, width, axes, scheme }) {
  const tallies = sampler.last.stats?.clients ?? [];
  return (
    <section id="clients" aria-labelledby="clients-title">
      <h2 id="clients-title">Prompt cache by client</h2>
      {tallies.length === 0 && <p class="muted">No requests since the model loaded.</p>}
      {tallies.map((tally) => {
        const rate = clientHitRate(tally);
        const series = sampler.clients.get(tally.client);
        return (
          <div class="client" key={tally.client} data-client={tally.client}>
            {visible && series && <Chart key={`${tally.client}-${scheme}`} chart={clientChart(tally.client)} data={series.data()} version={sampler.samples} width={width} axes={axes} />}
            <p class="client-tally">
              {tally.client}: {tally.requests} {tally.requests === 1 ? "request" : "requests"}, {rate == null ? "no prompt tokens" : `${Math.round(rate)}% of ${tally.prompt_tokens} prompt tokens from the cache`}
            </p>
            {tally.last_misses.length > 0 && (
              <ul class="misses" aria-label={`Last misses of ${tally.client}`}>
                {tally.last_misses.map((miss, k) => (
                  <li key={k}>
                    {ago(miss.at_unix_ms)}: {miss.cached_tokens} of {miss.prompt_tokens} tokens cached; {miss.description}
                  </li>
                ))}
              </ul>
            )}
          </div>
        );
      })}
    </section>
  );
}

/** `sampler`: a StatsSampler (started by the app); `visible`: whether the view is shown. */
export function Dashboard({ api, sampler, visible, inert }) {
  const section = useRef(null);
  const [, redraw] = useReducer((n) => n + 1, 0);
  useLayoutEffect(() => sampler.subscribe(redraw), [sampler]);
  // A change of colour scheme makes the graphs again (in the new colours).
  const [scheme, rebuild] = useReducer((n) => n + 1, 0);
  useEffect(() => {
    const media = globalThis.matchMedia?.("(prefers-color-scheme: dark)");
    media?.addEventListener?.("change", rebuild);
    return () => media?.removeEventListener?.("change", rebuild);
  }, []);
  const width = () => Math.max(280, (section.current.clientWidth || 400) - 24);
  const axes = visible ? axisColours() : null;
  return (
    <section id="view-dashboard" class="view" hidden={!visible} inert={inert} ref={section}>
      <div id="charts">
        {visible &&
          CHARTS.map((chart) => (
            <Chart key={`${chart.id}-${scheme}`} chart={chart} data={sampler.series.get(chart.id).data()} version={sampler.samples} width={width} axes={axes} />
          ))}
      </div>
      <Clients sampler={sampler} visible={visible} width={width} axes={axes} scheme={scheme} />
      <dl id="stats">
        {numbers(sampler.last).map(([name, value]) => [<dt key={`t-${name}`}>{name}</dt>, <dd key={`d-${name}`}>{value}</dd>])}
      </dl>
      <div class="row">
        <button type="button" id="clear-cache" onClick={() => api.clearCache().then(() => sampler.tick())}>
          Free MLX cache
        </button>
        <button type="button" id="reset-peak" onClick={() => api.resetPeakMemory().then(() => sampler.tick())}>
          Reset peak
        </button>
      </div>
    </section>
  );
}
