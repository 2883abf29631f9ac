import { describe, expect, it } from "vitest";
import { createRef } from "preact";
import { act, fireEvent, render } from "@testing-library/preact";
import { PRESET_CHOICES, SAMPLING_PRESETS, presetOf } from "../src/presets.js";
import { SettingsView } from "../src/settings.jsx";

async function setUp(api) {
  const handle = createRef();
  render(<SettingsView api={api} visible handle={handle} />);
  await act(() => handle.current.load());
  return () => act(async () => {
    fireEvent.submit(document.getElementById("settings-form"));
    await new Promise((resolve) => setTimeout(resolve, 0));
  });
}

/** Chooses `value` in the Sampling menu. */
function choose(preset, value) {
  preset.value = value;
  fireEvent.change(preset);
}

describe("sampling presets", () => {
  it("are recognised from their values only", () => {
    for (const [name, preset] of Object.entries(SAMPLING_PRESETS)) expect(presetOf({ ...preset.values })).toBe(name);
    expect(presetOf({ ...SAMPLING_PRESETS.balanced.values, temperature: 0.8 })).toBe(null);
    expect(presetOf({})).toBe(null);
    expect(presetOf(null)).toBe(null);
    expect(PRESET_CHOICES.map(([value]) => value)).toEqual(["model", "precise", "balanced", "creative", "custom"]);
  });

  it("set the chat's sampling from the Settings view, and Custom opens the fields", async () => {
    const sampling = { temperature: 0, top_p: 0, top_k: 0, min_p: 0, repetition_penalty: 0, presence_penalty: 0,
      frequency_penalty: 0, xtc_probability: 0, xtc_threshold: 0.1 };
    const settings = { chat: { sampling_source: "model", sampling, max_tokens: 512 }, server: {} };
    const saved = [];
    const reply = (s) => ({ settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 });
    const save = await setUp({
      getSettings: async () => reply(settings),
      saveSettings: async (s) => (saved.push(s), reply(s)),
      modelStatus: async () => ({ state: "loaded", name: "m", sampling_defaults: { source: "model", temperature: 0.6, top_p: 0.95, top_k: 20, min_p: 0, repetition_penalty: 1 } }),
    });
    const $ = (selector) => document.querySelector(selector);
    const field = (name) => $(`[data-setting='chat.sampling.${name}']`);
    const preset = $("#settings-preset");
    expect([...preset.options].map((o) => o.textContent)).toEqual(["The model's defaults", "Precise", "Balanced", "Creative", "Custom"]);
    expect(preset.value).toBe("model");
    expect(field("temperature").disabled).toBe(true);
    expect(field("temperature").value).toBe("0.6");

    choose(preset, "balanced");
    expect($("[data-setting='chat.sampling_source']").value).toBe("custom");
    expect(field("temperature").disabled).toBe(false);
    await save();
    expect(saved[0].chat.sampling_source).toBe("custom");
    expect(saved[0].chat.sampling).toMatchObject(SAMPLING_PRESETS.balanced.values);
    expect(preset.value).toBe("balanced");

    // Edited values are no preset any more.
    field("temperature").value = "0.8";
    fireEvent.input(field("temperature"));
    expect(preset.value).toBe("custom");
    // And set back to a preset's, they are that preset again.
    field("temperature").value = "0.7";
    fireEvent.input(field("temperature"));
    expect(preset.value).toBe("balanced");

    // Back to the model's defaults: the fields are read-only again and not saved as the user's.
    choose(preset, "model");
    expect(field("temperature").disabled).toBe(true);
    expect(field("temperature").value).toBe("0.6");
    await save();
    expect(saved[1].chat.sampling_source).toBe("model");
    expect(saved[1].chat.sampling.temperature).toBe(0.7);

    expect($("#settings-advanced").open).toBe(false);
    choose(preset, "custom");
    expect($("#settings-advanced").open).toBe(true);
    expect(field("temperature").disabled).toBe(false);
  });

  it("Custom with no model loaded starts from the saved values, never zeros, and stays Custom", async () => {
    const sampling = { temperature: 0.7, top_p: 0.9, top_k: 40, min_p: 0.05, repetition_penalty: 1.05, presence_penalty: 0,
      frequency_penalty: 0, xtc_probability: 0, xtc_threshold: 0.1 };
    const settings = { chat: { sampling_source: "model", sampling, max_tokens: 512 }, server: {} };
    await setUp({ getSettings: async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }) });
    const field = (name) => document.querySelector(`[data-setting='chat.sampling.${name}']`);
    expect(field("temperature").value).toBe(""); // following a model that is not loaded
    const preset = document.getElementById("settings-preset");
    choose(preset, "custom");
    expect([field("temperature").value, field("top_k").value]).toEqual(["0.7", "40"]);
    // These happen to be Balanced's values, but the choice made was Custom.
    expect(preset.value).toBe("custom");
  });
});
