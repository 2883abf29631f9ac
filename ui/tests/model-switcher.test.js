import { describe, expect, it } from "vitest";
import { ModelSwitcher, localFit, optionLabel } from "../src/model-switcher.js";
import { loadPage } from "./page.js";

const GB = 1e9;
const MODELS = [
  { name: "SmolLM2-135M", path: "/m/smol", size_bytes: 0.1 * GB, model_type: "llama" },
  { name: "Big-70B", path: "/m/big", size_bytes: 40 * GB, model_type: "llama" },
  { name: "mamba", path: "/m/mamba", size_bytes: 1 * GB, model_type: "mamba", architecture_note: "mamba is not supported yet" },
];

describe("model switcher", () => {
  it("says each model's size, whether it fits in 75% of RAM and whether Perch runs it", () => {
    expect(localFit(12 * GB, 16 * GB)).toBe("fits");
    expect(localFit(12.1 * GB, 16 * GB)).toBe("too_large");
    expect(localFit(1, null)).toBe(null);
    expect(localFit(null, 16 * GB)).toBe(null);
    expect(optionLabel(MODELS[0], 16 * GB)).toBe("SmolLM2-135M · 100 MB · fits");
    expect(optionLabel(MODELS[1], 16 * GB)).toBe("Big-70B · 40 GB · too large for this machine");
    expect(optionLabel(MODELS[2], 16 * GB)).toBe("mamba · 1.0 GB · not supported");
    expect(optionLabel(MODELS[0], null)).toBe("SmolLM2-135M · 100 MB");
  });

  it("lists the models, follows the loaded one and loads the one chosen", async () => {
    loadPage();
    const loads = [];
    const api = { listModels: async () => MODELS, systemStats: async () => ({ ram_total_bytes: 16 * GB }) };
    const select = document.getElementById("chat-model");
    const switcher = new ModelSwitcher(select, api, (path) => loads.push(path));
    switcher.setStatus({ state: "loaded", name: "SmolLM2-135M", path: "/m/smol" });
    await switcher.refresh();
    const options = [...select.options];
    expect(options.map((o) => [o.value, o.disabled])).toEqual([["", true], ["/m/smol", false], ["/m/big", false], ["/m/mamba", true]]);
    expect(options[3].title).toBe("mamba is not supported yet");
    expect(select.value).toBe("/m/smol");

    select.value = "/m/big";
    select.dispatchEvent(new Event("change"));
    expect(loads).toEqual(["/m/big"]);
    switcher.setStatus({ state: "loading", name: "Big-70B", bytes_read: 0, bytes_total: 1 });
    expect(select.disabled).toBe(true);
    switcher.setStatus({ state: "failed", name: "Big-70B", error: "too large" });
    expect([select.disabled, select.value]).toEqual([false, ""]);
    switcher.setStatus({ state: "loaded", name: "SmolLM2-135M", path: "/m/smol" });
    expect(select.value).toBe("/m/smol");
  });

  it("says where to get a model when there is none", async () => {
    loadPage();
    const select = document.getElementById("chat-model");
    const switcher = new ModelSwitcher(select, { listModels: async () => [], systemStats: async () => null }, () => {});
    await switcher.refresh();
    expect(select.options[0].textContent).toBe("No models on this machine: see Models");
  });

  it("shows a loaded model that is not in the list (loaded from elsewhere)", async () => {
    loadPage();
    const select = document.getElementById("chat-model");
    const switcher = new ModelSwitcher(select, { listModels: async () => [], systemStats: async () => null }, () => {});
    await switcher.refresh();
    switcher.setStatus({ state: "loaded", name: "SmolLM2-135M-Instruct-Q4_1", path: "/pypi/smollm2" });
    expect(select.value).toBe("/pypi/smollm2");
    expect(select.selectedOptions[0].textContent).toBe("SmolLM2-135M-Instruct-Q4_1");
    expect(select.options[0].textContent).toBe("Choose a model");
    // Listed again after a refresh.
    await switcher.refresh();
    expect(select.value).toBe("/pypi/smollm2");
  });
});
