import { describe, expect, it } from "vitest";
import { createRef } from "preact";
import { act, fireEvent, render } from "@testing-library/preact";
import { getPath, readInput, setPath, writeInput } from "../src/form.js";
import { SettingsView } from "../src/settings.jsx";

/** The Settings view shown, with `handle.current.load()` as app.jsx calls it. */
function setUp(api) {
  const handle = createRef();
  render(<SettingsView api={api} visible handle={handle} />);
  return { load: () => act(() => handle.current.load()) };
}

const field = (path) => document.querySelector(`[data-setting='${path}']`);
/** Submits the form, as its Save button does, and waits for the answer to be shown. */
const save = () => act(async () => {
  fireEvent.submit(document.getElementById("settings-form"));
  await new Promise((resolve) => setTimeout(resolve, 0));
});

describe("setting paths", () => {
  it("reads and writes nested values without changing the original", () => {
    const settings = { chat: { sampling: { temperature: 0 } }, block_size: 32 };
    const changed = setPath(settings, "chat.sampling.temperature", 0.7);
    expect(getPath(changed, "chat.sampling.temperature")).toBe(0.7);
    expect(settings.chat.sampling.temperature).toBe(0);
    expect(changed.block_size).toBe(32);
  });
});

describe("inputs", () => {
  it("scale MiB to bytes and back, and read empty optional fields as null", () => {
    document.body.innerHTML = `<input type="number" data-scale="1048576" id="kv">
      <input type="text" data-optional id="dir"><select data-type="number" id="bs"><option>8</option><option>64</option></select>`;
    const kv = document.getElementById("kv");
    writeInput(kv, 2 * 2 ** 30);
    expect(kv.value).toBe("2048");
    kv.value = "512";
    expect(readInput(kv)).toBe(512 * 2 ** 20);
    expect(readInput(document.getElementById("dir"))).toBe(null);
    const bs = document.getElementById("bs");
    writeInput(bs, 64);
    expect(readInput(bs)).toBe(64);
    document.body.innerHTML = `<input type="text" data-type="list" id="names">`;
    const names = document.getElementById("names");
    writeInput(names, ["claude-sonnet-4-5", "gpt-4o"]);
    expect(names.value).toBe("claude-sonnet-4-5, gpt-4o");
    names.value = "a,,b\n c";
    expect(readInput(names)).toEqual(["a", "b", "c"]);
    names.value = "  ";
    expect(readInput(names)).toEqual([]);
    document.body.innerHTML = "";
  });
});

describe("SettingsView", () => {
  it("turns the local server on with a port and key, and back to no key", async () => {
    const settings = { chat: {}, server: { enabled: false, port: 8080, api_key: null, allow_lan: false, any_model_name: false, model_aliases: [] } };
    const saved = [];
    const api = {
      getSettings: async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
      saveSettings: async (s) => {
        saved.push(s);
        return { settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 };
      },
    };
    const { load } = setUp(api);
    await load();
    expect([field("server.enabled").checked, field("server.port").value, field("server.api_key").value]).toEqual([false, "8080", ""]);
    field("server.enabled").checked = true;
    field("server.port").value = "1234";
    field("server.api_key").value = "sk-local";
    field("server.allow_lan").checked = true;
    field("server.any_model_name").checked = true;
    field("server.model_aliases").value = " claude-sonnet-4-5,gpt-4o  o3 ";
    await save();
    expect(saved[0].server).toEqual({ enabled: true, port: 1234, api_key: "sk-local", allow_lan: true, any_model_name: true,
      model_aliases: ["claude-sonnet-4-5", "gpt-4o", "o3"] });
    field("server.api_key").value = "  ";
    await save();
    expect(saved[1].server.api_key).toBe(null);
  });

  it("cannot be saved until the saved settings are in the form", async () => {
    const settings = { chat: {}, server: { enabled: false, port: 8080, api_key: null, allow_lan: false, any_model_name: false, model_aliases: [] } };
    let answer;
    const api = {
      getSettings: () => new Promise((resolve) => (answer = resolve)),
      saveSettings: async () => {
        throw new Error("saved before the settings were read");
      },
    };
    const handle = createRef();
    render(<SettingsView api={api} visible handle={handle} />);
    const root = document.getElementById("view-settings");
    const submit = root.querySelector("#settings-form button[type=submit]");
    expect([submit.disabled, root.dataset.ready]).toEqual([true, "false"]);
    // Loaded, and loaded again (the view shown again): not saveable from the moment it starts.
    for (const round of ["first load", "loaded again"]) {
      let loading;
      act(() => {
        loading = handle.current.load();
      });
      expect([submit.disabled, root.dataset.ready], round).toEqual([true, "false"]);
      await act(async () => {
        answer({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 });
        await loading;
      });
      expect([submit.disabled, root.dataset.ready], round).toEqual([false, "true"]);
    }

    // A settings file that cannot be read: the form says so and stays unsaveable.
    api.getSettings = async () => {
      throw "The settings file cannot be read.";
    };
    await act(() => handle.current.load());
    expect([submit.disabled, root.dataset.ready]).toEqual([true, "false"]);
    expect(root.querySelector("#settings-message").textContent).toBe("The settings file cannot be read.");
  });

  it("saves what the form shows and reports the error sentence", async () => {
    const settings = {
      chat: { system_prompt: "", sampling_source: "custom", sampling: { temperature: 0, top_p: 0, top_k: 0, min_p: 0, repetition_penalty: 0, logit_bias: {}, seed: null }, max_tokens: 1024 },
      kv_cache_bytes: 2 ** 31, block_size: 32, models_dir: null, launch_at_login: false, shortcut: "CommandOrControl+Shift+Space",
      server: { enabled: false, port: 8080, api_key: null, allow_lan: false, any_model_name: false, model_aliases: [] }, unload_after_idle_secs: 3600,
      prompt_lookup: false,
    };
    const saved = [];
    const api = {
      getSettings: async () => ({ settings, defaults: settings, models_dir: "/home/u/.local/share/perch/models", total_memory_bytes: 2 ** 34 }),
      saveSettings: async (s) => {
        saved.push(s);
        if (s.block_size !== 64) throw "Setting block_size: must be a power of two from 8 to 256, got 3.";
        return { settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 };
      },
    };
    const { load } = setUp(api);
    await load();
    expect(document.querySelector("[data-setting=kv_cache_bytes]").value).toBe("2048");
    expect(document.querySelector("[data-setting=kv_cache_bytes]").max).toBe("16384");
    expect(document.querySelector("[data-setting=models_dir]").placeholder).toContain("perch/models");
    document.querySelector("[data-setting='chat.sampling.temperature']").value = "0.7";
    document.querySelector("[data-setting=block_size]").value = "64";
    await save();
    expect(saved[0].chat.sampling.temperature).toBe(0.7);
    expect(saved[0].block_size).toBe(64);
    expect(saved[0].chat.sampling.logit_bias).toEqual({});
    expect(saved[0].models_dir).toBe(null);
    expect(saved[0].server).toEqual(settings.server);
    expect(saved[0].unload_after_idle_secs).toBe(3600); // shown as 60 minutes, saved as it was
    expect(document.getElementById("settings-message").textContent).toMatch(/^Saved/);
    // Minutes in the form, seconds in the file; empty is never.
    expect(field("unload_after_idle_secs").value).toBe("60");
    field("unload_after_idle_secs").value = "5";
    expect(saved[0].prompt_lookup).toBe(false);
    fireEvent.click(field("prompt_lookup"));
    await save();
    expect(saved[1].unload_after_idle_secs).toBe(300);
    expect(saved[1].prompt_lookup).toBe(true);
    field("unload_after_idle_secs").value = "";
    await save();
    expect(saved[2].unload_after_idle_secs).toBe(null);
    document.querySelector("[data-setting=block_size]").value = "8";
    await save();
    expect(document.getElementById("settings-message").textContent).toMatch(/^Setting block_size/);
  });

  it("says Saved again after the message was emptied (as the end-to-end test does between saves)", async () => {
    const settings = { chat: {}, launch_at_login: false, server: { enabled: false, port: 8080, api_key: null, allow_lan: false, any_model_name: false, model_aliases: [] } };
    const api = {
      getSettings: async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
      saveSettings: async (s) => ({ settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
    };
    const { load } = setUp(api);
    await load();
    const message = document.getElementById("settings-message");
    for (const on of [true, false]) {
      fireEvent.click(field("launch_at_login"));
      await save();
      expect(field("launch_at_login").checked).toBe(on);
      expect(message.textContent).toMatch(/^Saved\. /);
      message.textContent = "";
    }
  });

  it("shows the loaded model's sampling defaults read-only and saves the user's values only when custom", async () => {
    const sampling = { temperature: 0.3, top_p: 0, top_k: 0, min_p: 0, repetition_penalty: 0, logit_bias: {}, seed: null };
    const settings = { chat: { system_prompt: "", sampling_source: "model", sampling, max_tokens: 1024 },
      kv_cache_bytes: 2 ** 31, block_size: 32, server: { enabled: false, port: 8080, api_key: null, allow_lan: false, any_model_name: false, model_aliases: [] } };
    const saved = [];
    const { load } = setUp({
      getSettings: async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
      modelStatus: async () => ({ state: "loaded", name: "SmolLM2", path: "/m",
        sampling_defaults: { temperature: 0.8, top_p: 0.95, top_k: 40, min_p: 0.05, repetition_penalty: 1.1, repetition_context_size: 64, source: "perch" } }),
      saveSettings: async (s) => {
        saved.push(s);
        return { settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 };
      },
    });
    await load();
    expect([field("chat.sampling.temperature").disabled, field("chat.sampling.temperature").value]).toEqual([true, "0.8"]);
    expect(document.getElementById("settings-sampling-note").textContent).toBe("Perch's defaults: SmolLM2's generation_config.json names none.");
    await save();
    expect(saved[0].chat.sampling_source).toBe("model");
    expect(saved[0].chat.sampling.temperature).toBe(0.3); // the user's own value, kept
    // Read-only again after the save, still showing the model's value.
    expect([field("chat.sampling.temperature").disabled, field("chat.sampling.temperature").value]).toEqual([true, "0.8"]);
    field("chat.sampling_source").value = "custom";
    fireEvent.change(field("chat.sampling_source"));
    expect(field("chat.sampling.temperature").disabled).toBe(false);
    expect(document.getElementById("settings-sampling-note").textContent).toBe("");
    field("chat.sampling.temperature").value = "0.5";
    await save();
    expect(saved[1].chat).toMatchObject({ sampling_source: "custom", sampling: { temperature: 0.5, top_k: 40 } });
  });

  it("saves a custom source chosen in the same moment as the values, before any redraw", async () => {
    const sampling = { temperature: 0.3, top_p: 0, top_k: 0, min_p: 0, repetition_penalty: 0, logit_bias: {}, seed: null };
    const settings = { chat: { sampling_source: "model", sampling, max_tokens: 1024 }, server: {} };
    const saved = [];
    const { load } = setUp({
      getSettings: async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
      saveSettings: async (s) => (saved.push(s), { settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
    });
    await load();
    // As a script (the end-to-end test) does it: no redraw between these lines.
    field("chat.sampling_source").value = "custom";
    field("chat.sampling_source").dispatchEvent(new Event("change"));
    field("chat.sampling.temperature").value = "0";
    document.querySelector("#settings-form button[type=submit]").click();
    await act(() => new Promise((resolve) => setTimeout(resolve, 0)));
    expect(saved[0].chat).toMatchObject({ sampling_source: "custom", sampling: { temperature: 0 } });
  });

  it("lists hosts, reads their memory on demand and shows each one's share", async () => {
    const settings = { chat: { sampling_source: "custom", sampling: {}, max_tokens: 1024 }, server: {}, hosts: ["studio.local", "me@mini.local", "studio.local"] };
    const reading = {
      hosts: settings.hosts,
      memory_bytes: null,
      machines: [
        { login: "studio.local", ranks: 2, memory_bytes: 192e9, error: null, share: 2 / 3 },
        { login: "me@mini.local", ranks: 1, memory_bytes: null, error: "me@mini.local: its memory could not be read over ssh (timed out)", share: 1 / 3 },
      ],
    };
    let answer;
    const api = {
      getSettings: async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
      saveSettings: async (s) => ({ settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
      hostsStatus: async () => null,
      checkHosts: () => new Promise((resolve) => (answer = resolve)),
    };
    const { load } = setUp(api);
    await load();
    expect(field("hosts").value).toBe("studio.local, me@mini.local, studio.local");
    expect(document.querySelector("#hosts-reading code").textContent).toBe(
      "perch serve --model MODEL --distributed tensor --hosts studio.local,me@mini.local,studio.local",
    );
    expect(document.querySelector("table.hosts")).toBe(null);
    const check = document.getElementById("hosts-check");
    await act(() => fireEvent.click(check));
    // The UI does not wait on ssh: the button says so and stays pressed until the answer.
    expect(check.disabled).toBe(true);
    expect(check.textContent).toBe("Reading their memory…");
    await act(async () => answer(reading));
    expect(check.disabled).toBe(false);
    const rows = [...document.querySelectorAll("table.hosts tbody tr")].map((row) => [...row.children].map((cell) => cell.textContent));
    expect(rows).toEqual([
      ["studio.local", "2", "192 GB", "67%"],
      ["me@mini.local", "1", "me@mini.local: its memory could not be read over ssh (timed out)", "33%"],
    ]);
    expect(document.querySelector("table.hosts caption").textContent).toBe("2 machines, memory not known for all");
  });

  it("says models are judged against this machine alone without hosts", async () => {
    const settings = { chat: { sampling_source: "custom", sampling: {}, max_tokens: 1024 }, server: {}, hosts: [] };
    const { load } = setUp({
      getSettings: async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 2 ** 34 }),
    });
    await load();
    expect(document.getElementById("hosts-reading").textContent).toBe("No hosts: models are judged against this machine alone.");
    expect(document.getElementById("hosts-check")).toBe(null);
  });
});
