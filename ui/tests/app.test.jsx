import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { act, fireEvent, render } from "@testing-library/preact";
import { CommandError } from "../src/api.js";
import { App } from "../src/app.jsx";
import { fakeApi } from "./fake-api.js";
import { stubCanvas } from "./canvas.js";

const $ = (id) => document.getElementById(id);
const tick = (ms = 10) => act(() => new Promise((resolve) => setTimeout(resolve, ms)));
const nav = (view) => document.querySelector(`nav button[data-view=${view}]`);
const shownViews = () => [...document.querySelectorAll(".view")].filter((v) => !v.hidden).map((v) => v.id);

async function open(api) {
  render(<App api={api} storage={null} />, { container: document.body });
  await tick();
}

describe("App", () => {
  beforeEach(() => {
    stubCanvas();
  });
  afterEach(() => {
    vi.restoreAllMocks();
    vi.unstubAllGlobals();
  });

  it("lays the page out as the end-to-end test and the styles expect", async () => {
    await open(fakeApi());
    expect([...document.body.children].map((e) => e.id || e.tagName.toLowerCase())).toEqual([
      "onboarding", "nav", "notices", "model-status", "model-progress", "view-chat", "view-dashboard", "view-models", "view-settings",
    ]);
    expect(document.querySelector("nav").getAttribute("aria-label")).toBe("Views");
    expect([...document.querySelectorAll("nav button")].map((b) => [b.dataset.view, b.textContent])).toEqual([
      ["chat", "Chat"], ["dashboard", "Dashboard"], ["models", "Models"], ["settings", "Settings"],
    ]);
  });

  it("shows one view at a time and marks its button", async () => {
    const api = fakeApi();
    await open(api);
    expect(shownViews()).toEqual(["view-chat"]);
    expect(nav("chat").getAttribute("aria-current")).toBe("page");
    fireEvent.click(nav("dashboard"));
    expect(shownViews()).toEqual(["view-dashboard"]);
    expect([nav("chat").hasAttribute("aria-current"), nav("chat").classList.contains("active")]).toEqual([false, false]);
    expect([nav("dashboard").getAttribute("aria-current"), nav("dashboard").classList.contains("active")]).toEqual(["page", true]);
    await tick();
    expect(document.querySelectorAll("#charts canvas").length).toBe(5);

    // Models: the local list and, the first time, the Hub's.
    fireEvent.click(nav("models"));
    await tick();
    expect(shownViews()).toEqual(["view-models"]);
    expect(api.listModels).toHaveBeenCalled();
    expect(api.searchModels).toHaveBeenCalledTimes(1);

    // Back to the chat: the model switcher lists the models again.
    const listed = api.listModels.mock.calls.length;
    fireEvent.click(nav("chat"));
    await tick();
    expect(api.listModels.mock.calls.length).toBe(listed + 1);
  });

  it("reads the settings each time their view is shown, unsaveable until they arrive", async () => {
    const api = fakeApi();
    await open(api);
    fireEvent.click(nav("settings"));
    expect($("view-settings").dataset.ready).toBe("false");
    await tick();
    expect($("view-settings").dataset.ready).toBe("true");
    fireEvent.click(nav("chat"));
    fireEvent.click(nav("settings"));
    // Not ready from the click on: a script waiting for "true" never sees the last load's.
    expect($("view-settings").dataset.ready).toBe("false");
    await tick();
    expect($("view-settings").dataset.ready).toBe("true");
    expect(api.getSettings.mock.calls.length).toBe(3); // the first run's check, then twice
  });

  it("says the model's state in the status line, with a bar while it loads", async () => {
    let status = { state: "not_loaded" };
    const api = fakeApi({ modelStatus: vi.fn(async () => status) });
    await open(api);
    expect($("model-status").textContent).toBe("No model loaded.");
    expect($("model-progress").hidden).toBe(true);
    status = { state: "loading", name: "Qwen3", bytes_read: 1, bytes_total: 4 };
    await tick(1100);
    expect($("model-status").textContent).toMatch(/^Loading Qwen3… 25% of 0 MiB, \d s$/);
    expect($("model-status").classList.contains("loading")).toBe(true);
    expect([$("model-progress").hidden, $("model-progress").value]).toEqual([false, 0.25]);
    status = { state: "loaded", name: "Qwen3", path: "/m/qwen3" };
    await tick(1100);
    expect($("model-status").textContent).toBe("Model: Qwen3");
    expect($("model-status").classList.contains("loading")).toBe(false);
    expect($("model-progress").hidden).toBe(true);
  });

  it("loads the model chosen in the switcher, following its progress, and unloads", async () => {
    let status = { state: "not_loaded" };
    let release;
    const api = fakeApi({
      modelStatus: vi.fn(async () => status),
      listModels: vi.fn(async () => [{ name: "Qwen3", path: "/m/qwen3", size_bytes: 1e9, fit: "fits" }]),
      loadModel: vi.fn(() => new Promise((resolve) => (release = resolve))),
      unloadModel: vi.fn(async () => (status = { state: "not_loaded" })),
    });
    await open(api);
    const select = $("chat-model");
    select.value = "/m/qwen3";
    fireEvent.change(select);
    expect(api.loadModel).toHaveBeenCalledWith("/m/qwen3");
    status = { state: "loading", name: "Qwen3", bytes_read: 0, bytes_total: 0 };
    await tick(300); // polled every 250 ms while it loads
    expect($("model-status").textContent).toMatch(/^Loading Qwen3…/);
    expect(select.disabled).toBe(true);
    status = { state: "loaded", name: "Qwen3", path: "/m/qwen3" };
    release();
    await tick();
    expect($("model-status").textContent).toBe("Model: Qwen3");
    expect([select.disabled, select.value]).toEqual([false, "/m/qwen3"]);
    fireEvent.click(nav("models"));
    fireEvent.click($("unload"));
    await tick();
    expect(api.unloadModel).toHaveBeenCalled();
    expect($("model-status").textContent).toBe("No model loaded.");
  });

  it("says startup notices, the tray's failures and unhandled ones until dismissed", async () => {
    const api = fakeApi({ startupNotices: async () => ["The history was damaged: a copy was kept."] });
    await open(api);
    const notices = () => [...document.querySelectorAll("#notices > .notice")];
    expect(notices().map((n) => n.textContent)).toEqual(["The history was damaged: a copy was kept. Dismiss"]);
    act(() => api.emit.notice(new CommandError({ kind: "network", message: "dns error" })));
    expect(notices()[1].querySelector(".error").textContent).toMatch(/^Perch can't reach the Hugging Face Hub\./);
    act(() => window.dispatchEvent(Object.assign(new Event("unhandledrejection"), { reason: "The engine stopped." })));
    expect(notices()[2].textContent).toBe("The engine stopped. Dismiss");
    fireEvent.click([...notices()[0].querySelectorAll("button")].find((b) => b.textContent === "Dismiss"));
    expect(notices().length).toBe(2);
    expect(notices()[1].textContent).toBe("The engine stopped. Dismiss");
    // The same failure again is not a second notice.
    act(() => window.dispatchEvent(Object.assign(new Event("unhandledrejection"), { reason: "The engine stopped." })));
    expect(notices().length).toBe(2);
  });

  it("a view that fails to draw says so in its place, once, with Try again", async () => {
    // A saved answer whose sampling record lacks its parameters: drawing it throws.
    const broken = { role: "assistant", content: "Hi", finish_reason: "stop", stats: null, error: null, sampling: { params: null } };
    const api = fakeApi({
      listConversations: async () => [{ id: 1, title: "Old chat" }],
      getConversation: async (id) => ({ id, title: "Old chat", settings: {}, messages: [broken] }),
    });
    await open(api);
    await tick(50);
    const alert = document.querySelector("[role=alert].notice");
    expect(alert).not.toBe(null);
    expect([...alert.querySelectorAll("button")].map((b) => b.textContent)).toEqual(["Try again"]);
    // The other views still draw, and no notice repeats the failure.
    expect(document.getElementById("view-settings")).not.toBe(null);
    expect(document.querySelectorAll("#notices > .notice").length).toBeLessThanOrEqual(1);
  });

  it("follows the tray: a view to show, a new chat, settings changed elsewhere", async () => {
    const api = fakeApi();
    await open(api);
    act(() => api.emit.navigate("dashboard"));
    expect(shownViews()).toEqual(["view-dashboard"]);
    await act(() => api.emit.newChat());
    await tick();
    expect(api.createConversation).toHaveBeenCalledTimes(1);
    const reads = api.getSettings.mock.calls.length;
    act(() => api.emit.settingsChanged());
    await tick();
    expect(api.getSettings.mock.calls.length).toBe(reads + 1);
  });

  it("keeps the page behind the first-run screen out of reach, and gives the composer the focus after it", async () => {
    const api = fakeApi({ getSettings: vi.fn(async () => ({ settings: { first_run_done: false } })) });
    await open(api);
    await tick();
    expect($("onboarding").hidden).toBe(false);
    const behind = [...document.body.children].filter((e) => e.id !== "onboarding");
    expect(behind.every((e) => e.hasAttribute("inert"))).toBe(true);
    expect($("onboarding").hasAttribute("inert")).toBe(false);
    fireEvent.click(nav("dashboard")); // as a script might: the dialog closes back to the chat
    fireEvent.click($("onboarding-skip"));
    await tick();
    expect($("onboarding").hidden).toBe(true);
    expect(behind.some((e) => e.hasAttribute("inert"))).toBe(false);
    expect(shownViews()).toEqual(["view-chat"]);
    expect(document.activeElement).toBe($("input"));
    expect(api.finishFirstRun).toHaveBeenCalledTimes(1);
  });
});
