import { describe, expect, it } from "vitest";
import { useState } from "preact/hooks";
import { act, fireEvent, render } from "@testing-library/preact";
import { CommandError } from "../src/api.js";
import { Onboarding, describeMachine, firstRunPending } from "../src/onboarding.jsx";

const GB = 1e9;
const tick = () => new Promise((resolve) => setTimeout(resolve, 0));
const $ = (id) => document.getElementById(id);
const items = () => [...document.querySelectorAll("#onboarding-models > li")];
const buttonIn = (item, label) => [...item.querySelectorAll("button")].find((b) => b.textContent === label);

function memoryStorage() {
  const values = new Map();
  return { getItem: (k) => values.get(k) ?? null, setItem: (k, v) => values.set(k, String(v)) };
}

function fakeApi({ offline = false } = {}) {
  const api = {
    calls: [],
    firstRunDone: false,
    getSettings: async () => ({ settings: { first_run_done: api.firstRunDone } }),
    finishFirstRun: async () => {
      api.calls.push(["finish"]);
      api.firstRunDone = true;
    },
    systemStats: async () => ({ ram_total_bytes: 16 * GB, usable_memory_bytes: 12 * GB }),
    listModels: async () => [
      { name: "SmolLM2-135M", path: "/m/smol", size_bytes: 0.1 * GB, fit: "fits" },
      { name: "Huge", path: "/m/huge", size_bytes: 40 * GB, fit: "too_large" },
      { name: "mamba", path: "/m/mamba", size_bytes: 1 * GB, fit: "fits", architecture_note: "not supported" },
    ],
    searchModels: async () => {
      if (offline) throw new CommandError({ kind: "network", message: "cannot reach https://huggingface.co/api/models: dns error" });
      return [
        { id: "mlx-community/Qwen3-4B-4bit", fit: "fits", weights_bytes: 2.3 * GB, downloads: 5000 },
        { id: "mlx-community/Llama-70B-4bit", fit: "too_large", weights_bytes: 40 * GB, downloads: 900 },
        { id: "mlx-community/Mamba-4bit", fit: "fits", weights_bytes: 1 * GB, downloads: 80, architecture_note: "not supported" },
      ];
    },
    downloadModel: (repo, onProgress) =>
      new Promise((resolve, reject) => {
        api.calls.push(["download", repo]);
        api.progress = onProgress;
        api.finish = () => resolve({ snapshot_dir: `/hf/${repo}` });
        api.fail = reject;
      }),
    cancelDownload: async (repo) => api.calls.push(["cancel", repo]),
  };
  return api;
}

/** The first-run screen opened as app.jsx opens it; closed by its onDone, as app.jsx does. */
async function setUp(api, onLoad) {
  const loads = [];
  let done = 0;
  function Harness() {
    const [open, setOpen] = useState(true);
    const close = () => {
      done += 1;
      setOpen(false);
    };
    return <Onboarding api={api} open={open} onLoad={onLoad ?? (async (path) => loads.push(path))} onDone={close} />;
  }
  render(<Harness />);
  await act(tick);
  return { loads, done: () => done };
}

describe("first run", () => {
  it("describes the machine's memory", () => {
    expect(describeMachine({ ram_total_bytes: 16 * GB, usable_memory_bytes: 12 * GB })).toBe(
      "This machine has 16 GB of memory: models up to about 12 GB fit.",
    );
    expect(describeMachine(null)).toMatch(/could not read/);
  });

  it("offers the models here and the Hub's that fit, downloads one with progress, loads it and opens the chat", async () => {
    const api = fakeApi();
    const storage = memoryStorage();
    expect(await firstRunPending(api, storage)).toBe(true);
    const { loads, done } = await setUp(api);
    expect($("onboarding").hidden).toBe(false);
    expect(document.activeElement).toBe($("onboarding-title"));
    expect($("onboarding-machine").textContent).toContain("16 GB of memory");
    // Here: the one that fits and runs; the Hub: the one that fits, runs and is not here.
    expect(items().map((li) => li.querySelector(".repo").textContent)).toEqual(["SmolLM2-135M", "mlx-community/Qwen3-4B-4bit"]);
    const offer = items()[1];
    expect(offer.textContent).toContain("2.3 GB · 5,000 downloads");
    expect(buttonIn(offer, "Download").getAttribute("aria-label")).toBe("Download mlx-community/Qwen3-4B-4bit");
    fireEvent.click(buttonIn(offer, "Download"));
    expect(document.activeElement).toBe(buttonIn(offer, "Cancel"));
    await tick();
    api.progress({ bytes_done: 1, bytes_total: 4, files_done: 0, files_total: 2 });
    await tick();
    expect(offer.querySelector("progress").value).toBe(0.25);
    expect(offer.querySelector(".progress-text").textContent).toContain("25%");
    buttonIn(offer, "Cancel").click();
    expect(api.calls).toContainEqual(["cancel", "mlx-community/Qwen3-4B-4bit"]);
    api.finish();
    await tick();
    await tick();
    expect(loads).toEqual(["/hf/mlx-community/Qwen3-4B-4bit"]);
    expect($("onboarding").hidden).toBe(true);
    expect(done()).toBe(1);
    expect(await firstRunPending(api, storage)).toBe(false);
    expect(api.calls.filter(([call]) => call === "finish").length).toBe(1);
    expect(storage.getItem("perch.onboarded")).toBe(null);
  });

  it("is remembered in the settings, and where earlier versions remembered it is moved there", async () => {
    const api = fakeApi();
    const storage = memoryStorage();
    api.firstRunDone = true;
    expect(await firstRunPending(api, storage)).toBe(false);
    api.firstRunDone = false;
    storage.setItem("perch.onboarded", "1");
    expect(await firstRunPending(api, storage)).toBe(false);
    expect(api.firstRunDone).toBe(true);
  });

  it("offline: says so in plain words and offers the models already here", async () => {
    const { loads } = await setUp(fakeApi({ offline: true }));
    expect($("onboarding-message").textContent).toContain("Perch can't reach the Hugging Face Hub");
    expect($("onboarding-message").textContent).toContain("already on this machine are ready");
    expect(items().length).toBe(1);
    buttonIn(items()[0], "Use").click();
    await tick();
    expect(loads).toEqual(["/m/smol"]);
    expect($("onboarding").hidden).toBe(true);
  });

  it("says when no model fits", async () => {
    const api = { ...fakeApi(), listModels: async () => [], searchModels: async () => [] };
    await setUp(api);
    expect(items().length).toBe(0);
    expect($("onboarding-message").textContent).toBe("No model that fits was found; you can pick one under Models later.");
  });

  it("a failed download says why and can be tried again; Skip ends the first run", async () => {
    const api = fakeApi();
    const { done } = await setUp(api);
    const offer = items()[1];
    buttonIn(offer, "Download").click();
    await tick();
    api.fail(new CommandError({ kind: "storage", message: "No space left on device (os error 28)" }));
    await tick();
    expect(offer.querySelector(".error").textContent).toContain("The disk is full.");
    expect(offer.querySelector("progress")).toBe(null);
    expect(buttonIn(offer, "Download").hidden).toBe(false);
    expect(buttonIn(offer, "Download").disabled).toBe(false);
    expect(document.activeElement).toBe(buttonIn(offer, "Download"));
    // Tried again: the error goes while it downloads.
    buttonIn(offer, "Download").click();
    await tick();
    expect(offer.querySelector(".error")).toBe(null);
    expect(api.calls.filter(([call]) => call === "download").length).toBe(2);
    $("onboarding-skip").click();
    expect(done()).toBe(1);
    expect(await firstRunPending(api, null)).toBe(false);
  });

  it("Skip during a download cancels it, loads nothing and ends the first run once", async () => {
    const api = fakeApi();
    const { loads, done } = await setUp(api);
    const [local, offer] = items();
    buttonIn(offer, "Download").click();
    await tick();
    // One at a time: the other models' buttons are off while it downloads.
    expect(buttonIn(local, "Use").disabled).toBe(true);
    $("onboarding-skip").click();
    expect(api.calls).toContainEqual(["cancel", "mlx-community/Qwen3-4B-4bit"]);
    api.finish(); // the download ended anyway
    await tick();
    await tick();
    expect(loads).toEqual([]);
    $("onboarding-start").click();
    expect(done()).toBe(1);
  });

  it("says it is loading while a model here loads", async () => {
    let release;
    await setUp(fakeApi(), () => new Promise((resolve) => (release = resolve)));
    fireEvent.click(buttonIn(items()[0], "Use"));
    expect($("onboarding-message").textContent).toBe("Loading the model…");
    expect(buttonIn(items()[1], "Download").disabled).toBe(true);
    release();
    await tick();
    expect($("onboarding").hidden).toBe(true);
  });
});
