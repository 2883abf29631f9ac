import { afterEach } from "vitest";
import { cleanup } from "@testing-library/preact";

// What jsdom lacks and the UI's libraries expect: uPlot asks matchMedia for the pixel ratio.
window.matchMedia ??= () => ({
  matches: false,
  addEventListener() {},
  removeEventListener() {},
  addListener() {},
  removeListener() {},
});

// Each test starts from an empty page: what testing-library rendered is unmounted.
afterEach(cleanup);
