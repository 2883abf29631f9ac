// Every screen of the page passes axe-core's WCAG 2.1 A/AA rules that jsdom can evaluate (all
// but colour contrast, which needs layout: tests/contrast.test.js checks the colour tokens).
import { beforeEach, describe, expect, it } from "vitest";
import axe from "axe-core";
import { ChatView } from "../src/chat.js";
import { addIcons } from "../src/icons.js";
import { ModelsView } from "../src/models.js";
import { Onboarding } from "../src/onboarding.js";
import { loadPage } from "./page.js";

const views = ["chat", "dashboard", "models", "settings"];
const $ = (id) => document.getElementById(id);

function showView(view) {
  for (const section of document.querySelectorAll(".view")) section.hidden = section.id !== `view-${view}`;
}

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

describe("accessibility", () => {
  beforeEach(() => {
    loadPage();
    addIcons(document);
  });

  for (const view of views) {
    it(`the ${view} screen has no violations`, async () => {
      showView(view);
      expect(await violations()).toEqual([]);
    });
  }

  it("a conversation with answers, code and an error has no violations", async () => {
    showView("chat");
    const view = new ChatView($("view-chat"), {});
    view.conversation = {
      id: 1, title: "Sorting", settings,
      messages: [
        { id: 1, role: "user", content: "Sort a list in Python" },
        { id: 2, role: "assistant", content: "Use `sorted`:\n\n```python\nsorted([3, 1, 2])\n```", stats, finish_reason: "stop" },
        { id: 3, role: "user", content: "And in place?" },
        { id: 4, role: "assistant", content: "", error: "The model stopped: out of memory." },
      ],
    };
    view.render();
    view.showError("Something failed.");
    expect(await violations()).toEqual([]);
  });

  it("the models screen with local models, results and a download has no violations", async () => {
    showView("models");
    const api = {
      partialDownloads: async () => [{ repo_id: "mlx-community/Paused-4bit", bytes_present: 3e8, has_snapshot: false }],
      listModels: async () => [
        { name: "SmolLM2-135M", path: "/m/a", model_type: "llama", quantization_bits: 4, size_bytes: 1e8, source: "perch" },
        { name: "Mamba", path: "/m/b", model_type: "mamba", size_bytes: 1e8, source: "hf_cache", architecture_note: "Perch does not run mamba." },
      ],
    };
    const view = new ModelsView($("view-models"), api, () => {});
    await view.refreshLocal();
    view.lastResults = [
      { id: "mlx-community/Qwen3-4B-4bit", fit: "fits", weights_bytes: 2e9, downloads: 1000, model_type: "qwen3", context_tokens: 32768 },
      { id: "mlx-community/Big-8bit", fit: "too_large", weights_bytes: 9e10, downloads: 10, model_type: "llama" },
    ];
    view.downloads.set("mlx-community/Qwen3-4B-4bit", { bytes_done: 1e9, bytes_total: 2e9 });
    view.failures.set("mlx-community/Big-8bit", "The download failed: the disk is full.");
    view.renderResults();
    expect(await violations()).toEqual([]);
  });

  it("the model loading bar has a name when shown", async () => {
    $("model-progress").hidden = false;
    expect(await violations()).toEqual([]);
  });

  it("the first-run screen has no violations", async () => {
    const api = {
      systemStats: async () => ({ ram_total_bytes: 16e9, usable_memory_bytes: 12e9 }),
      listModels: async () => [{ name: "SmolLM2-135M", path: "/m/smol", size_bytes: 1e8, fit: "fits" }],
      searchModels: async () => [{ id: "mlx-community/Qwen3-4B-4bit", fit: "fits", weights_bytes: 2.3e9, downloads: 5000 }],
    };
    const view = new Onboarding($("onboarding"), api, { onLoad: async () => {}, onDone: () => {}, storage: null });
    await view.open();
    expect(await violations()).toEqual([]);
  });
});
