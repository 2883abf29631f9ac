// jsdom has no 2D canvas: uPlot gets a context and paths whose every method does nothing.
import { vi } from "vitest";

/** Stubs `Path2D` and `getContext`; `onContext` is called each time a chart asks for a context.
 * Undone by `vi.restoreAllMocks()` and `vi.unstubAllGlobals()`. */
export function stubCanvas(onContext = () => {}) {
  const noop = (target) => new Proxy(target, { get: (t, key) => (key in t ? t[key] : () => ({ width: 0 })) });
  const context = noop({});
  vi.stubGlobal("Path2D", function Path2D() { return noop({}); });
  vi.spyOn(HTMLCanvasElement.prototype, "getContext").mockImplementation(() => {
    onContext();
    return context;
  });
}
