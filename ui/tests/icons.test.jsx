import { describe, expect, it } from "vitest";
import { act, render } from "@testing-library/preact";
import { App } from "../src/app.jsx";
import { Icon, ICONS } from "../src/icons.jsx";
import { fakeApi } from "./fake-api.js";

describe("icons", () => {
  it("are drawn once before the controls' text, hidden from screen readers", async () => {
    render(<App api={fakeApi()} storage={null} />, { container: document.body });
    await act(() => new Promise((resolve) => setTimeout(resolve, 0)));
    const marked = [...document.querySelectorAll("[data-icon]")];
    expect(marked.length).toBeGreaterThanOrEqual(8);
    for (const control of marked) {
      const icons = control.querySelectorAll(":scope > svg.icon");
      expect(icons.length, control.outerHTML).toBe(1);
      expect(control.firstElementChild).toBe(icons[0]);
      expect(icons[0].classList.contains(`lucide-${{ chat: "message-square", dashboard: "activity", models: "boxes", settings: "settings", "new-chat": "plus", send: "send", stop: "square", menu: "menu", attach: "image-plus" }[control.dataset.icon]}`)).toBe(true);
    }
    for (const svg of document.querySelectorAll("svg.icon")) {
      expect(svg.getAttribute("aria-hidden")).toBe("true");
      expect([svg.getAttribute("width"), svg.getAttribute("height")]).toEqual(["16", "16"]);
      expect(svg.querySelector("path, rect, circle, line, polyline")).not.toBe(null);
    }
    expect(document.querySelector("nav button[data-view=chat]").textContent).toBe("Chat");
    expect(document.getElementById("send").textContent).toBe("Send");
    expect(document.getElementById("toggle-conversations").textContent).toBe("");
  });

  it("has one for every name the controls use", () => {
    expect(Object.keys(ICONS).sort()).toEqual(["attach", "chat", "dashboard", "menu", "models", "new-chat", "send", "settings", "stop"]);
    const { container } = render(<Icon name="send" />);
    expect(container.querySelector("svg.icon.lucide-send")).not.toBe(null);
  });
});
