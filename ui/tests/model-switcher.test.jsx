import { describe, expect, it } from "vitest";
import { createRef } from "preact";
import { act, fireEvent, render } from "@testing-library/preact";
import { ModelSwitcher, optionLabel } from "../src/model-switcher.jsx";

const GB = 1e9;
const MODELS = [
  { name: "SmolLM2-135M", path: "/m/smol", size_bytes: 0.1 * GB, model_type: "llama", fit: "fits" },
  { name: "Big-70B", path: "/m/big", size_bytes: 40 * GB, model_type: "llama", fit: "too_large" },
  { name: "mamba", path: "/m/mamba", size_bytes: 1 * GB, model_type: "mamba", fit: "fits", architecture_note: "mamba is not supported yet" },
];
const tick = () => act(() => new Promise((resolve) => setTimeout(resolve, 0)));

/** The switcher with `status`; `show(status)` gives it the next model_status. */
async function setUp(api, status, onLoad = () => {}) {
  const handle = createRef();
  const { rerender } = render(<ModelSwitcher api={api} status={status} onLoad={onLoad} handle={handle} />);
  await tick();
  return {
    select: document.getElementById("chat-model"),
    show: (next) => rerender(<ModelSwitcher api={api} status={next} onLoad={onLoad} handle={handle} />),
    refresh: () => act(() => handle.current.refresh()),
  };
}

describe("model switcher", () => {
  it("says each model's size, whether it fits (list_models' fit) and whether Perch runs it", () => {
    expect(optionLabel(MODELS[0])).toBe("SmolLM2-135M · 100 MB · fits in memory");
    expect(optionLabel({ ...MODELS[0], name: "gemma-3-4b", vision: true })).toBe("gemma-3-4b · 100 MB · sees images · fits in memory");
    expect(optionLabel(MODELS[1])).toBe("Big-70B · 40 GB · too large for this machine");
    expect(optionLabel(MODELS[2])).toBe("mamba · 1.0 GB · not supported");
    expect(optionLabel({ ...MODELS[0], fit: "tight" })).toBe("SmolLM2-135M · 100 MB · fits with a smaller KV cache");
    expect(optionLabel({ ...MODELS[0], fit: "unknown" })).toBe("SmolLM2-135M · 100 MB");
  });

  it("lists the models, follows the loaded one and loads the one chosen", async () => {
    const loads = [];
    const api = { listModels: async () => MODELS };
    const { select, show } = await setUp(api, { state: "loaded", name: "SmolLM2-135M", path: "/m/smol" }, (path) => loads.push(path));
    const options = [...select.options];
    expect(options.map((o) => [o.value, o.disabled])).toEqual([["", true], ["/m/smol", false], ["/m/big", false], ["/m/mamba", true]]);
    expect(options[3].title).toBe("mamba is not supported yet");
    expect(select.getAttribute("aria-label")).toBe("Model");
    expect(select.value).toBe("/m/smol");

    select.value = "/m/big";
    fireEvent.change(select);
    expect(loads).toEqual(["/m/big"]);
    show({ state: "loading", name: "Big-70B", bytes_read: 0, bytes_total: 1 });
    expect(select.disabled).toBe(true);
    show({ state: "failed", name: "Big-70B", error: "too large" });
    expect([select.disabled, select.value]).toEqual([false, ""]);
    show({ state: "loaded", name: "SmolLM2-135M", path: "/m/smol" });
    expect(select.value).toBe("/m/smol");
    // Choosing the loaded model again loads nothing.
    fireEvent.change(select);
    expect(loads).toEqual(["/m/big"]);
  });

  it("leaves the choice alone while the status says the same (it is polled every second)", async () => {
    const api = { listModels: async () => MODELS };
    const status = { state: "loaded", name: "SmolLM2-135M", path: "/m/smol" };
    const { select, show } = await setUp(api, status, () => {});
    select.value = "/m/big"; // chosen, its load not started yet
    show({ ...status });
    expect(select.value).toBe("/m/big");
  });

  it("says where to get a model when there is none", async () => {
    const { select } = await setUp({ listModels: async () => [] }, null);
    expect(select.options[0].textContent).toBe("No models on this machine: see Models");
  });

  it("shows a loaded model that is not in the list (loaded from elsewhere)", async () => {
    const { select, show, refresh } = await setUp({ listModels: async () => [] }, null);
    show({ state: "loaded", name: "SmolLM2-135M-Instruct-Q4_1", path: "/pypi/smollm2" });
    expect(select.value).toBe("/pypi/smollm2");
    expect(select.selectedOptions[0].textContent).toBe("SmolLM2-135M-Instruct-Q4_1");
    expect(select.options[0].textContent).toBe("Choose a model");
    // Listed again after a refresh.
    await refresh();
    expect(select.value).toBe("/pypi/smollm2");
  });
});
