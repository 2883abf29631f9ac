// The colour tokens of src/style.css, light and dark, meet WCAG 2.1 AA: text 4.5:1 on every surface
// it is used on (1.4.3), control borders and the focus ring 3:1 against the page (1.4.11). The
// contrast ratio and relative luminance as WCAG 2.1 defines them.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { describe, expect, it } from "vitest";

const css = readFileSync(join(process.cwd(), "src/style.css"), "utf8");

/** The `--name: #rrggbb` tokens of the first `:root { … }` block after `from`. */
function tokens(from) {
  const start = css.indexOf(":root {", css.indexOf(from));
  const block = css.slice(start, css.indexOf("}", start));
  return Object.fromEntries([...block.matchAll(/--([a-z0-9-]+):\s*(#[0-9a-f]{6})\s*;/gi)].map((m) => [m[1], m[2]]));
}

function luminance(hex) {
  const channel = (i) => {
    const c = parseInt(hex.slice(1 + 2 * i, 3 + 2 * i), 16) / 255;
    return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
  };
  return 0.2126 * channel(0) + 0.7152 * channel(1) + 0.0722 * channel(2);
}

export function contrast(a, b) {
  const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x);
  return (hi + 0.05) / (lo + 0.05);
}

const light = tokens("/* Perch's design tokens");
const dark = { ...light, ...tokens("@media (prefers-color-scheme: dark)") };

// [foreground, background, minimum]
const pairs = [
  ...["bg", "surface", "surface-2"].flatMap((s) => [
    ["text", s, 4.5],
    ["text-muted", s, 4.5],
    ["accent-text", s, 4.5],
    ["danger", s, 4.5],
  ]),
  ["accent-text", "accent-soft", 4.5],
  // Highlighted code, on the code blocks' background.
  ...["code-keyword", "code-string", "code-number", "code-title", "code-type", "code-comment", "text"].map((fg) => [fg, "surface-2", 4.5]),
  ["warning-text", "bg", 4.5],
  ["warning-text", "warning-bg", 4.5],
  ["on-accent", "accent", 4.5],
  ["border-strong", "bg", 3],
  ["border-strong", "surface", 3],
  ["focus", "bg", 3],
  ["focus", "surface", 3],
];

describe("colour tokens", () => {
  it("match WCAG's own examples", () => {
    expect(contrast("#000000", "#ffffff")).toBeCloseTo(21, 5);
    expect(contrast("#777777", "#ffffff")).toBeCloseTo(4.48, 2);
  });

  for (const [name, scheme] of [["light", light], ["dark", dark]]) {
    it(`meet AA in the ${name} scheme`, () => {
      const failing = pairs
        .filter(([fg, bg, min]) => !(contrast(scheme[fg], scheme[bg]) >= min))
        .map(([fg, bg, min]) => `${fg} on ${bg}: ${contrast(scheme[fg], scheme[bg]).toFixed(2)} < ${min}`);
      expect(failing).toEqual([]);
    });
  }

  it("are all defined in both schemes", () => {
    for (const [fg, bg] of pairs) {
      for (const scheme of [light, dark]) {
        expect(scheme[fg], fg).toMatch(/^#/);
        expect(scheme[bg], bg).toMatch(/^#/);
      }
    }
  });
});
