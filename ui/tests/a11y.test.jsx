// Every screen of the app passes axe-core's WCAG 2.1 A/AA rules that jsdom can evaluate (all
// but colour contrast, which needs layout: tests/contrast.test.js checks the colour tokens).
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { act, fireEvent, render } from "@testing-library/preact";
import axe from "axe-core";
import { App } from "../src/app.jsx";
import { fakeApi } from "./fake-api.js";
import { stubCanvas } from "./canvas.js";

const views = ["chat", "dashboard", "models", "settings"];
const $ = (id) => document.getElementById(id);
const tick = () => act(() => new Promise((resolve) => setTimeout(resolve, 10)));

const settings = {
  system_prompt: "", sampling_source: "model", max_tokens: 1024,
  sampling: { temperature: 0, top_p: 0, top_k: 0, min_p: 0, repetition_penalty: 0, logit_bias: {}, seed: null },
};
const stats = { prompt_tokens: 20, cached_prompt_tokens: 16, generation_tokens: 3, generation_tps: 9, ttft_s: 0.1, prompt_tps: 1, total_s: 1, peak_memory_bytes: 0 };

async function violations() {
  const result = await axe.run(document.body, {
    runOnly: { type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "best-practice"] },
    rules: { "color-contrast": { enabled: false }, region: { enabled: false } },
  });
  return result.violations.map((v) => `${v.id}: ${v.nodes.map((n) => n.target.join(" ")).join(", ")}`);
}

/** The app drawn with `api`, settled; `view` shown. */
async function open(api, view = "chat") {
  render(<App api={api} storage={null} />, { container: document.body });
  await tick();
  fireEvent.click(document.querySelector(`nav button[data-view=${view}]`));
  await tick();
}

describe("accessibility", () => {
  beforeEach(() => {
    stubCanvas();
  });
  afterEach(() => {
    vi.restoreAllMocks();
    vi.unstubAllGlobals();
  });

  for (const view of views) {
    it(`the ${view} screen has no violations`, async () => {
      await open(fakeApi(), view);
      expect($(`view-${view}`).hidden).toBe(false);
      expect(await violations()).toEqual([]);
    });
  }

  it("the models screen says in a list item that no model is here", async () => {
    await open(fakeApi(), "models");
    expect(document.querySelector("#models > li").textContent).toMatch(/^No models found/);
    expect(await violations()).toEqual([]);
  });

  it("a conversation with answers, code and an error has no violations", async () => {
    const conversation = {
      id: 1, title: "Sorting", settings,
      messages: [
        { id: 1, role: "user", content: "Sort a list in Python" },
        { id: 2, role: "assistant", content: "Use `sorted`:\n\n```python\nsorted([3, 1, 2])\n```", stats, finish_reason: "stop" },
        { id: 3, role: "user", content: "And in place?" },
        { id: 4, role: "assistant", content: "", error: "The model stopped: out of memory." },
      ],
    };
    const api = fakeApi({
      listConversations: async () => [{ id: 1, title: "Sorting" }],
      getConversation: async () => conversation,
      // A refused turn: its error is shown under the messages.
      chat: async () => Promise.reject("Something failed."),
    });
    await open(api, "chat");
    $("input").value = "Again?";
    fireEvent.click($("send"));
    await tick();
    expect($("chat-error").textContent).toBe("Something failed.");
    expect(document.querySelectorAll("#messages li .code-block").length).toBe(1);
    expect(await violations()).toEqual([]);
  });

  it("the models screen with local models, results and a download has no violations", async () => {
    const api = fakeApi({
      partialDownloads: async () => [{ repo_id: "mlx-community/Paused-4bit", bytes_present: 3e8, has_snapshot: false }],
      listModels: async () => [
        { name: "SmolLM2-135M", path: "/m/a", model_type: "llama", quantization_bits: 4, size_bytes: 1e8, source: "perch" },
        { name: "Mamba", path: "/m/b", model_type: "mamba", size_bytes: 1e8, source: "hf_cache", architecture_note: "Perch does not run mamba." },
      ],
      searchModels: async () => [
        { id: "mlx-community/Qwen3-4B-4bit", fit: "fits", weights_bytes: 2e9, downloads: 1000, model_type: "qwen3", context_tokens: 32768 },
        { id: "mlx-community/Big-8bit", fit: "too_large", weights_bytes: 9e10, downloads: 10, model_type: "llama" },
      ],
      downloadModel: (repo, onProgress) => {
        if (repo === "mlx-community/Big-8bit") return Promise.reject("The download failed: the disk is full.");
        onProgress({ bytes_done: 1e9, bytes_total: 2e9, files_done: 0, files_total: 2 });
        return new Promise(() => {});
      },
    });
    await open(api, "models");
    for (const item of document.querySelectorAll("#hub-results > li")) {
      fireEvent.click([...item.querySelectorAll("button")].find((b) => b.textContent === "Download"));
    }
    await tick();
    expect(document.querySelector("#hub-results progress")).not.toBe(null);
    expect(document.querySelector("#hub-results .error")).not.toBe(null);
    expect($("partial-section").hidden).toBe(false);
    expect(await violations()).toEqual([]);
  });

  it("the model loading bar has a name when shown", async () => {
    await open(fakeApi({ modelStatus: async () => ({ state: "loading", name: "Qwen3", bytes_read: 1, bytes_total: 4 }) }));
    expect($("model-progress").hidden).toBe(false);
    expect(await violations()).toEqual([]);
  });

  it("the first-run screen has no violations", async () => {
    const api = fakeApi({
      getSettings: async () => ({ settings: { first_run_done: false } }),
      listModels: async () => [{ name: "SmolLM2-135M", path: "/m/smol", size_bytes: 1e8, fit: "fits" }],
      searchModels: async () => [{ id: "mlx-community/Qwen3-4B-4bit", fit: "fits", weights_bytes: 2.3e9, downloads: 5000 }],
    });
    render(<App api={api} storage={null} />, { container: document.body });
    await tick();
    await tick();
    expect($("onboarding").hidden).toBe(false);
    expect(document.querySelectorAll("#onboarding-models > li").length).toBe(2);
    expect(await violations()).toEqual([]);
  });
});
