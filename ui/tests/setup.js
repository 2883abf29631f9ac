// What jsdom lacks and the UI's libraries expect: uPlot asks matchMedia for the pixel ratio.
window.matchMedia ??= () => ({
  matches: false,
  addEventListener() {},
  removeEventListener() {},
  addListener() {},
  removeListener() {},
});
