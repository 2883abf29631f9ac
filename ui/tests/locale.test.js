import { expect, it } from "vitest";

it("a POSIX 'C' locale does not stop number formatting (uPlot needs it at load)", async () => {
  Object.defineProperty(window.navigator, "language", { value: "C", configurable: true });
  expect(() => new Intl.NumberFormat("C")).toThrow(RangeError);
  await import("../src/locale.js");
  expect(new Intl.NumberFormat(navigator.language).format(1234.5)).toMatch(/1.?234.5/);
  expect(new Intl.NumberFormat("de-DE").format(1.5)).toBe("1,5");
  await import("uplot"); // loads without throwing
});
