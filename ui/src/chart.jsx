// One uPlot graph in a <figure>: made when mounted, fed new data when `version` changes, resized
// to `width()`, destroyed when unmounted.

import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";
import { useLayoutEffect, useRef } from "preact/hooks";

const COLORS = ["#3b82f6", "#ef4444", "#10b981", "#f59e0b", "#8b5cf6"];

/**
 * `chart`: {id, title, series: [[key, label], ...]} (stats.js' CHARTS); `data`: its columns (a
 * TimeSeries', read as they are); `version`: changes with every new sample; `width()`: the width to
 * draw at, measured once the figure is in the page; `axes`: uPlot's axis style (colours).
 */
export function Chart({ chart, data, version, width, axes }) {
  const figure = useRef(null);
  const plot = useRef(null);
  useLayoutEffect(() => {
    plot.current = new uPlot(
      {
        title: chart.title,
        width: width(),
        height: 140,
        scales: { x: { time: true } },
        series: [{}, ...chart.series.map(([, label], i) => ({ label, stroke: COLORS[i], width: 1.5, points: { show: false } }))],
        legend: { live: false },
        axes: [{ ...axes }, { ...axes, size: 50 }],
      },
      data,
      figure.current,
    );
    return () => plot.current.destroy();
  }, []);
  const drawn = useRef(version);
  useLayoutEffect(() => {
    if (drawn.current === version) return; // just made with this data
    drawn.current = version;
    const w = width();
    if (plot.current.width !== w) plot.current.setSize({ width: w, height: 140 });
    plot.current.setData(data);
  }, [version]);
  return <figure class="chart" data-chart={chart.id} ref={figure} />;
}
