import { describe, expect, it } from "vitest";
import { addIcons } from "../src/icons.js";
import { loadPage } from "./page.js";

describe("icons", () => {
  it("are drawn once before the controls' text, hidden from screen readers", () => {
    loadPage();
    const marked = document.querySelectorAll("[data-icon]").length;
    expect(addIcons(document)).toBe(marked);
    expect(marked).toBeGreaterThanOrEqual(8);
    for (const svg of document.querySelectorAll("svg.icon")) {
      expect(svg.getAttribute("aria-hidden")).toBe("true");
      expect(svg.querySelector("path, rect, circle, line, polyline")).not.toBe(null);
    }
    expect(document.querySelector("nav button[data-view=chat]").textContent).toBe("Chat");
    expect(document.getElementById("send").textContent).toBe("Send");
    expect(addIcons(document)).toBe(0);
  });
});
