import { describe, expect, it, vi } from "vitest";
import { createRef } from "preact";
import { act, fireEvent, render } from "@testing-library/preact";
import { CommandError } from "../src/api.js";
import { ModelsView } from "../src/models.jsx";

const QWEN = { id: "mlx-community/Qwen3-0.6B-4bit", downloads: 1234, weights_bytes: 335_000_000, fit: "fits", context_tokens: 18724, snapshot_dir: null };
const BIG = { id: "mlx-community/Big-70B", downloads: 5, weights_bytes: null, fit: "unknown", snapshot_dir: null };

/** A fake of api.js whose download waits until the test finishes or fails it. */
function fakeApi() {
  const calls = [];
  let local = [{ name: "SmolLM2", path: "/m/SmolLM2", model_type: "llama", quantization_bits: 4, size_bytes: 2 ** 27, source: "perch" }];
  const api = {
    calls,
    partial: [],
    listModels: async () => local,
    partialDownloads: async () => api.partial,
    discardPartialDownload: async (repo) => {
      calls.push(["discard", repo]);
      if (repo === "org/locked") throw new CommandError({ kind: "storage", message: "permission denied" });
      api.partial = api.partial.filter((d) => d.repo_id !== repo);
      return 5e6;
    },
    searchModels: async (text, author) => {
      calls.push(["search", text, author]);
      return [{ ...QWEN }, { ...BIG }];
    },
    downloadModel: (repo, onProgress, revision) =>
      new Promise((resolve, reject) => {
        calls.push(revision ? ["download", repo, revision] : ["download", repo]);
        api.progress = onProgress;
        api.finish = () => {
          local = [...local, { name: repo, path: `/hf/${repo}`, model_type: "qwen3", size_bytes: 1, source: "hugging_face" }];
          resolve({ snapshot_dir: `/hf/${repo}`, bytes_fetched: 1, bytes_reused: 0 });
        };
        api.fail = (error) => reject(error);
      }),
    cancelDownload: async (repo) => calls.push(["cancel", repo]),
  };
  return api;
}

const tick = () => new Promise((resolve) => setTimeout(resolve, 0));
const results = () => [...document.querySelectorAll("#hub-results > li")];
const buttonIn = (item, label) => [...item.querySelectorAll("button")].find((b) => b.textContent === label);

/** The models view, with `handle.current.show()` as app.jsx calls it when the view is shown. */
function setUp(api, onLoad = () => {}) {
  const handle = createRef();
  render(<ModelsView api={api} visible onLoad={onLoad} handle={handle} />);
  return { show: () => act(() => handle.current.show()) };
}

describe("ModelsView", () => {
  it("marks the models that see images", async () => {
    const api = fakeApi();
    const gemma = { name: "gemma-3-4b", path: "/m/gemma", model_type: "gemma3", quantization_bits: 4, size_bytes: 2 ** 27, source: "perch", vision: true };
    const plain = await api.listModels();
    api.listModels = async () => [...plain, gemma];
    const { show } = setUp(api);
    await show();
    const local = document.querySelectorAll("#models > li");
    expect(local[0].querySelector(".badge.vision")).toBe(null);
    expect(local[1].querySelector(".badge.vision").textContent).toBe("Sees images");
  });

  it("lists local models and the Hub's mlx-community models with size and fit", async () => {
    const api = fakeApi();
    const loaded = [];
    const { show } = setUp(api, (path) => loaded.push(path));
    await show();

    const local = document.querySelectorAll("#models > li");
    expect(local.length).toBe(1);
    expect(local[0].textContent).toContain("SmolLM2 (llama, 4-bit, 128 MiB, Perch's models)");
    expect(local[0].querySelector(".badge.vision")).toBe(null);
    buttonIn(local[0], "Load").click();
    expect(loaded).toEqual(["/m/SmolLM2"]);

    expect(api.calls).toEqual([["search", "", "mlx-community"]]);
    // The KV budget's tokens for this model, from its config; nothing said when unknown.
    expect(results()[0].textContent).toContain("335 MB · fits in memory · KV cache holds 18,724 tokens · 1,234 downloads");
    expect(results()[1].textContent).toContain("size unknown · fit unknown · 5 downloads");

    document.getElementById("hub-search").value = " qwen ";
    document.getElementById("hub-author").value = "";
    document.getElementById("hub-form").requestSubmit();
    await tick();
    expect(api.calls.at(-1)).toEqual(["search", "qwen", ""]);
    // Shown a second time: the local list again, not the search.
    await show();
    expect(api.calls.filter(([call]) => call === "search").length).toBe(2);
  });

  it("shows download progress, cancels, and lists and loads the model once downloaded", async () => {
    const api = fakeApi();
    const loaded = [];
    const { show } = setUp(api, (path) => loaded.push(path));
    await show();

    buttonIn(results()[0], "Download").click();
    await tick();
    expect(api.calls.at(-1)).toEqual(["download", QWEN.id]);
    expect(results()[0].textContent).toContain("Starting…");
    api.progress({ repo_id: QWEN.id, file: "model.safetensors", bytes_done: 250, bytes_total: 1000, files_done: 1, files_total: 4 });
    await tick();
    const item = results()[0];
    expect(item.querySelector("progress").value).toBe(0.25);
    expect(item.querySelector("progress").getAttribute("aria-label")).toBe(`Downloading ${QWEN.id}`);
    expect(item.textContent).toContain("25% of 1.0 kB (file 2 of 4)");
    buttonIn(item, "Cancel").click();
    expect(api.calls.at(-1)).toEqual(["cancel", QWEN.id]);

    api.finish();
    await tick();
    await tick();
    expect(document.querySelectorAll("#models > li").length).toBe(2);
    expect(results()[0].querySelector("progress")).toBe(null);
    buttonIn(results()[0], "Load").click();
    expect(loaded).toEqual([`/hf/${QWEN.id}`]);
  });

  it("shows only the latest search's answer, and Load for a model downloaded while a search ran", async () => {
    const api = fakeApi();
    const answers = [];
    api.searchModels = (text, author) =>
      new Promise((resolve) => {
        api.calls.push(["search", text, author]);
        answers.push(resolve);
      });
    const loaded = [];
    setUp(api, (path) => loaded.push(path));
    // Two searches at once: the older one answers last.
    const form = document.getElementById("hub-form");
    form.requestSubmit();
    form.requestSubmit();
    await tick();
    expect(answers.length).toBe(2);
    expect(document.getElementById("hub-message").textContent).toBe("Searching…");
    answers[1]([{ ...QWEN }]);
    await tick();
    answers[0]([{ ...QWEN }, { ...BIG }]);
    await tick();
    expect(results().map((li) => li.dataset.repo)).toEqual([QWEN.id]);

    // A search answered during a download brings new result objects that do not know it finished.
    buttonIn(results()[0], "Download").click();
    await tick();
    form.requestSubmit();
    await tick();
    answers[2]([{ ...QWEN }]);
    await tick();
    expect(buttonIn(results()[0], "Cancel")).toBeDefined();
    api.finish();
    await tick();
    await tick();
    buttonIn(results()[0], "Load").click();
    expect(loaded).toEqual([`/hf/${QWEN.id}`]);
  });

  it("says why a download failed and offers it again", async () => {
    const api = fakeApi();
    const { show } = setUp(api);
    await show();
    buttonIn(results()[1], "Download").click();
    await tick();
    api.fail("Not enough disk space in /hf: the download needs 9 more bytes, 1 are free.");
    await tick();
    const item = results()[1];
    expect(item.querySelector(".error").textContent).toContain("Not enough disk space");
    expect(item.querySelector("progress")).toBe(null);
    // Offered again: the button starts a second download of the same model.
    const again = buttonIn(item, "Download");
    expect(again?.disabled).toBe(false);
    again.click();
    await tick();
    expect(api.calls.filter(([call]) => call === "download")).toEqual([
      ["download", BIG.id],
      ["download", BIG.id],
    ]);
    expect(results()[1].querySelector("progress")).not.toBe(null);
    expect(results()[1].querySelector(".error")).toBe(null);
  });

  it("says which models Perch does not run yet, before downloading and on this machine", async () => {
    const note = "mamba is not supported yet (Perch runs gemma3, gemma3_text, llama, mistral, qwen2, qwen3, qwen3_5, qwen3_moe)";
    const api = {
      partialDownloads: async () => [],
      listModels: async () => [
        { name: "mamba", path: "/m/mamba", model_type: "mamba", size_bytes: 1, source: "perch", architecture_note: note },
      ],
      searchModels: async () => [
        { ...QWEN, model_type: "qwen3", architecture_note: null },
        { id: "mlx-community/mamba-130m-hf-f32", downloads: 9, weights_bytes: 3e9, fit: "fits", snapshot_dir: null, model_type: "mamba", architecture_note: note },
      ],
    };
    const { show } = setUp(api);
    await show();
    const local = document.querySelector("#models > li");
    expect(local.querySelector(".unsupported").textContent).toBe(`Not supported yet (${note}) `);
    expect(buttonIn(local, "Load").disabled).toBe(true);
    expect(results()[0].querySelector(".unsupported")).toBe(null);
    expect(results()[0].textContent).toContain("1,234 downloads · qwen3");
    expect(results()[1].querySelector(".unsupported").title).toBe(note);
    expect(buttonIn(results()[1], "Download").disabled).toBe(false);
  });

  it("reports a search that fails, and an empty one", async () => {
    const raw = "cannot reach https://huggingface.co/api/models: io: failed to lookup address information.";
    const api = { ...fakeApi(), searchModels: async () => Promise.reject(new CommandError({ kind: "network", message: raw })) };
    const { show } = setUp(api);
    await show();
    const message = document.getElementById("hub-message");
    expect(message.textContent).toContain("Perch can't reach the Hugging Face Hub. Check your internet connection");
    expect(message.querySelector("details code").textContent).toBe(raw);
    expect(results().length).toBe(0);
    api.searchModels = async () => [];
    document.getElementById("hub-form").requestSubmit();
    await tick();
    expect(message.textContent).toBe("No models found.");
  });

  it("filters the results by fit and support, and shows the disk the local models take", async () => {
    const api = {
      ...fakeApi(),
      searchModels: async () => [
        { ...QWEN, model_type: "qwen3", architecture_note: null },
        { ...BIG, fit: "too_large" },
        { id: "mlx-community/mamba", downloads: 9, weights_bytes: 3e9, fit: "fits", snapshot_dir: null, architecture_note: "mamba is not supported yet" },
      ],
    };
    const { show } = setUp(api);
    await show();
    expect(document.getElementById("models-disk").textContent).toBe("1 model, 134 MB on disk");
    expect(results().length).toBe(3);
    const check = (id, on) => {
      const box = document.getElementById(id);
      box.checked = on;
      fireEvent.change(box);
    };
    check("hub-only-fits", true);
    expect(results().map((li) => li.dataset.repo)).toEqual([QWEN.id, "mlx-community/mamba"]);
    check("hub-only-supported", true);
    expect(results().map((li) => li.dataset.repo)).toEqual([QWEN.id]);
    expect(document.getElementById("hub-hidden").textContent).toBe("2 more hidden by the filters.");
    check("hub-only-fits", false);
    check("hub-only-supported", false);
    expect(results().length).toBe(3);
    expect(document.getElementById("hub-hidden").textContent).toBe("");
  });

  it("judges models against the hosts too, and keeps those that fit them under the fit filter", async () => {
    const api = {
      ...fakeApi(),
      listModels: async () => [{ name: "SmolLM2", path: "/m/SmolLM2", model_type: "llama", quantization_bits: 4, size_bytes: 2 ** 27, source: "perch", group_fit: "fits" }],
      searchModels: async () => [
        { ...QWEN, group_fit: "fits" },
        { ...BIG, weights_bytes: 140e9, fit: "too_large", group_fit: "tight" },
        { ...BIG, id: "mlx-community/Huge-400B", weights_bytes: 800e9, fit: "too_large", group_fit: "fits" },
      ],
    };
    const { show } = setUp(api);
    await show();
    expect(document.querySelector("#models li").textContent).toContain("fits your hosts");
    expect(results()[1].textContent).toContain("140 GB · too large for this machine, fits your hosts with a smaller KV cache · 5 downloads");
    expect(results()[2].textContent).toContain("800 GB · too large for this machine, fits your hosts · 5 downloads");
    const box = document.getElementById("hub-only-fits");
    box.checked = true;
    fireEvent.change(box);
    expect(results().map((li) => li.dataset.repo)).toEqual([QWEN.id, "mlx-community/Huge-400B"]);
  });

  it("downloads the revision asked for", async () => {
    const api = fakeApi();
    const { show } = setUp(api);
    await show();
    document.getElementById("hub-revision").value = " v1.1 ";
    buttonIn(results()[0], "Download").click();
    await tick();
    expect(api.calls.at(-1)).toEqual(["download", QWEN.id, "v1.1"]);
  });

  it("lists stopped downloads, resumes one with its progress and discards another", async () => {
    const api = fakeApi();
    api.partial = [
      { repo_id: "org/paused", bytes_present: 12e6, has_snapshot: false },
      { repo_id: "org/older", bytes_present: 5e6, has_snapshot: true, revision: "v2" },
      { repo_id: "org/locked", bytes_present: 1, has_snapshot: false },
    ];
    const { show } = setUp(api);
    await show();
    const section = document.getElementById("partial-section");
    const stopped = () => [...document.querySelectorAll("#partial-downloads > li")];
    expect(section.hidden).toBe(false);
    expect(stopped().map((li) => li.textContent)).toEqual([
      "org/paused (12 MB fetched) Resume Discard",
      "org/older (5.0 MB fetched, at v2, another revision complete) Resume Discard",
      "org/locked (1 B fetched) Resume Discard",
    ]);

    // Resume: its bar shows in the list while it runs; once done it is listed as local.
    buttonIn(stopped()[0], "Resume").click();
    await tick();
    expect(api.calls.at(-1)).toEqual(["download", "org/paused", "main"]);
    api.progress({ repo_id: "org/paused", file: "model.safetensors", bytes_done: 500, bytes_total: 1000, files_done: 0, files_total: 1 });
    await tick();
    expect(stopped()[0].querySelector("progress").value).toBe(0.5);
    expect(buttonIn(stopped()[0], "Cancel")).toBeDefined();
    api.partial = api.partial.slice(1);
    api.finish();
    await tick();
    await tick();
    expect(stopped().map((li) => li.dataset.repo)).toEqual(["org/older", "org/locked"]);
    expect([...document.querySelectorAll("#models > li")].map((li) => li.textContent)).toContain(
      "org/paused (qwen3, 0 MiB, Hugging Face cache) Load Delete",
    );

    // Discard: the space freed, or why not.
    buttonIn(stopped()[0], "Discard").click();
    await tick();
    await tick();
    expect(api.calls.at(-1)).toEqual(["discard", "org/older"]);
    expect(document.getElementById("partial-status").textContent).toBe("Discarded the download of org/older: 5.0 MB freed.");
    expect(stopped().map((li) => li.dataset.repo)).toEqual(["org/locked"]);
    const locked = buttonIn(stopped()[0], "Discard");
    locked.click();
    await tick();
    expect(document.getElementById("partial-status").querySelector(".error")).not.toBe(null);
    expect(locked.disabled).toBe(false);

    api.partial = [];
    await show();
    expect(section.hidden).toBe(true);
  });

  it("resumes a stopped download at the revision it asked for, whatever the field says", async () => {
    const api = fakeApi();
    api.partial = [{ repo_id: "org/older", bytes_present: 5e6, has_snapshot: false, revision: "v2" }];
    const { show } = setUp(api);
    await show();
    document.getElementById("hub-revision").value = "v9";
    const item = document.querySelector("#partial-downloads > li");
    expect(buttonIn(item, "Resume").getAttribute("aria-label")).toBe("Resume downloading org/older at v2");
    buttonIn(item, "Resume").click();
    await tick();
    expect(api.calls.at(-1)).toEqual(["download", "org/older", "v2"]);
    api.fail("stopped");
    await tick();
  });

  it("a listing that fails after a download leaves no bar behind, and a failed stopped-download listing is said", async () => {
    const api = fakeApi();
    const { show } = setUp(api);
    await show();
    buttonIn(results()[0], "Download").click();
    await tick();
    api.listModels = async () => Promise.reject(new CommandError({ kind: "storage", message: "permission denied" }));
    api.finish();
    await tick();
    await tick();
    expect(results()[0].querySelector("progress")).toBe(null);
    expect(buttonIn(results()[0], "Cancel")).toBeUndefined();
    expect(document.querySelector("#models > li > .error")).not.toBe(null);

    api.partialDownloads = async () => Promise.reject(new CommandError({ kind: "storage", message: "permission denied" }));
    await expect(show()).rejects.toBeInstanceOf(CommandError);
    expect(document.getElementById("partial-section").hidden).toBe(false);
    expect(document.querySelector("#partial-status .error")).not.toBe(null);
  });

  it("deletes a local model after a confirmation, saying the space freed or why not", async () => {
    let local = [
      { name: "SmolLM2", path: "/m/SmolLM2", model_type: "llama", size_bytes: 2 ** 27, source: "perch" },
      { name: "Loaded", path: "/m/Loaded", model_type: "llama", size_bytes: 1, source: "perch" },
    ];
    const deleted = [];
    const api = {
      ...fakeApi(),
      listModels: async () => local,
      deleteModel: async (path) => {
        if (path === "/m/Loaded") throw new CommandError({ kind: "invalid_input", message: "Loaded is loaded: unload it or load another model before deleting it." });
        deleted.push(path);
        local = local.filter((m) => m.path !== path);
        return 2 ** 27;
      },
    };
    const { show } = setUp(api);
    await show();
    const item = () => [...document.querySelectorAll("#models > li")];
    const button = buttonIn(item()[0], "Delete");
    expect(button.getAttribute("aria-label")).toBe("Delete SmolLM2");
    fireEvent.click(button);
    expect(deleted).toEqual([]); // the first click asks for a confirmation
    expect(button.textContent).toBe("Confirm delete");
    expect(button.getAttribute("aria-label")).toBe("Confirm delete SmolLM2");
    expect(button.classList.contains("confirm")).toBe(true);
    fireEvent.click(button);
    await tick();
    await tick();
    expect(deleted).toEqual(["/m/SmolLM2"]);
    expect(document.getElementById("models-deleted").textContent).toBe("Deleted SmolLM2: 134 MB freed.");
    expect(item().length).toBe(1);
    expect(document.getElementById("models-disk").textContent).toBe("1 model, 1 B on disk");

    // Two clicks before a redraw still ask, then delete (here refused: it is loaded).
    const refused = buttonIn(item()[0], "Delete");
    refused.click();
    refused.click();
    await tick();
    expect(document.getElementById("models-deleted").textContent).toContain("unload it or load another model");
    expect(refused.disabled).toBe(false);
  });

  it("the confirmation of a delete lapses after 4 seconds", async () => {
    vi.useFakeTimers();
    try {
      const api = { ...fakeApi(), deleteModel: async () => 1 };
      const { show } = setUp(api);
      await show();
      const button = buttonIn(document.querySelector("#models > li"), "Delete");
      fireEvent.click(button);
      expect(button.textContent).toBe("Confirm delete");
      await act(() => vi.advanceTimersByTimeAsync(4000));
      expect(button.textContent).toBe("Delete");
    } finally {
      vi.useRealTimers();
    }
  });

  it("says when no model is on this machine", async () => {
    const { show } = setUp({ ...fakeApi(), listModels: async () => [] });
    await show();
    expect(document.getElementById("models").textContent).toBe("No models found in Perch's models directory or the Hugging Face cache.");
    expect(document.getElementById("models-disk").textContent).toBe("");
  });
});
