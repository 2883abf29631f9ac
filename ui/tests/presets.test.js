import { describe, expect, it } from "vitest";
import { SAMPLING_PRESETS, presetOf } from "../src/presets.js";
import { SettingsView } from "../src/settings.js";
import { loadPage } from "./page.js";

describe("sampling presets", () => {
  it("are recognised from their values only", () => {
    for (const [name, preset] of Object.entries(SAMPLING_PRESETS)) expect(presetOf({ ...preset.values })).toBe(name);
    expect(presetOf({ ...SAMPLING_PRESETS.balanced.values, temperature: 0.8 })).toBe(null);
    expect(presetOf({})).toBe(null);
    expect(presetOf(null)).toBe(null);
  });

  it("set the chat's sampling from the Settings view, and Custom opens the fields", async () => {
    loadPage();
    const sampling = { temperature: 0, top_p: 0, top_k: 0, min_p: 0, repetition_penalty: 0, presence_penalty: 0,
      frequency_penalty: 0, xtc_probability: 0, xtc_threshold: 0.1 };
    const settings = { chat: { sampling_source: "model", sampling, max_tokens: 512 }, server: {} };
    const saved = [];
    const reply = (s) => ({ settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 });
    const api = {
      getSettings: async () => reply(settings),
      saveSettings: async (s) => (saved.push(s), reply(s)),
      modelStatus: async () => ({ state: "loaded", name: "m", sampling_defaults: { source: "model", temperature: 0.6, top_p: 0.95, top_k: 20, min_p: 0, repetition_penalty: 1 } }),
    };
    const view = new SettingsView(document.getElementById("view-settings"), api);
    await view.load();
    const $ = (selector) => document.querySelector(selector);
    const field = (name) => $(`[data-setting='chat.sampling.${name}']`);
    const preset = $("#settings-preset");
    expect(preset.value).toBe("model");
    expect(field("temperature").disabled).toBe(true);
    expect(field("temperature").value).toBe("0.6");

    preset.value = "balanced";
    preset.dispatchEvent(new Event("change"));
    expect($("[data-setting='chat.sampling_source']").value).toBe("custom");
    expect(field("temperature").disabled).toBe(false);
    await view.save();
    expect(saved[0].chat.sampling_source).toBe("custom");
    expect(saved[0].chat.sampling).toMatchObject(SAMPLING_PRESETS.balanced.values);
    expect(preset.value).toBe("balanced");

    // Edited values are no preset any more.
    field("temperature").value = "0.8";
    field("temperature").dispatchEvent(new Event("input"));
    expect(preset.value).toBe("custom");

    // Back to the model's defaults: the fields are read-only again and not saved as the user's.
    preset.value = "model";
    preset.dispatchEvent(new Event("change"));
    expect(field("temperature").disabled).toBe(true);
    await view.save();
    expect(saved[1].chat.sampling_source).toBe("model");

    expect($("#settings-advanced").open).toBe(false);
    preset.value = "custom";
    preset.dispatchEvent(new Event("change"));
    expect($("#settings-advanced").open).toBe(true);
    expect(field("temperature").disabled).toBe(false);
  });

  it("Custom with no model loaded starts from the saved values, never zeros, and stays Custom", async () => {
    loadPage();
    const sampling = { temperature: 0.7, top_p: 0.9, top_k: 40, min_p: 0.05, repetition_penalty: 1.05, presence_penalty: 0,
      frequency_penalty: 0, xtc_probability: 0, xtc_threshold: 0.1 };
    const settings = { chat: { sampling_source: "model", sampling, max_tokens: 512 }, server: {} };
    const api = { getSettings: async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }) };
    const view = new SettingsView(document.getElementById("view-settings"), api);
    await view.load();
    const field = (name) => document.querySelector(`[data-setting='chat.sampling.${name}']`);
    expect(field("temperature").value).toBe(""); // following a model that is not loaded
    const preset = document.getElementById("settings-preset");
    preset.value = "custom";
    preset.dispatchEvent(new Event("change"));
    expect([field("temperature").value, field("top_k").value]).toEqual(["0.7", "40"]);
    // These happen to be Balanced's values, but the choice made was Custom.
    expect(preset.value).toBe("custom");
  });
});
