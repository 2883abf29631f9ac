import { describe, expect, it } from "vitest";
import { decimalBytes, describeDownload, describeModelStatus, describeSampling, describeStats, mib } from "../src/format.js";

const stats = {
  prompt_tokens: 40,
  cached_prompt_tokens: 32,
  generation_tokens: 12,
  generation_tps: 10.44,
  ttft_s: 0.2504,
};

describe("describeStats", () => {
  it("gives tokens, TTFT, tok/s and cached prompt tokens", () => {
    expect(describeStats(stats, "stop")).toBe("12 tokens · TTFT 250 ms · 10.4 tok/s · 32 of 40 prompt tokens cached");
  });
  it("says when the answer was stopped or cut by the limit", () => {
    const plain = { ...stats, cached_prompt_tokens: 0 };
    expect(describeStats(plain, "cancelled")).toBe("12 tokens · TTFT 250 ms · 10.4 tok/s · stopped");
    expect(describeStats(plain, "length")).toMatch(/hit the token limit$/);
    expect(describeStats({ ...plain, cut_for_memory: true }, "length")).toMatch(/cut short: out of KV memory$/);
  });
  it("gives the share of a draft model's proposals accepted", () => {
    const drafted = { ...stats, cached_prompt_tokens: 0, draft_tokens: 12, accepted_draft_tokens: 9 };
    expect(describeStats(drafted, "stop")).toBe("12 tokens · TTFT 250 ms · 10.4 tok/s · draft 75% accepted");
    expect(describeStats({ ...drafted, draft_tokens: 0, accepted_draft_tokens: 0 }, "stop")).not.toMatch(/draft/);
  });
});

describe("mib and model status", () => {
  it("formats bytes and missing values", () => {
    expect(mib(3 * 2 ** 20)).toBe("3 MiB");
    expect(mib(null)).toBe("—");
  });
  it("describes every model state", () => {
    expect(describeModelStatus({ state: "loading", name: "m", bytes_read: 0, bytes_total: 0 }, 2.4)).toBe("Loading m… 2 s");
    const halfway = { state: "loading", name: "m", bytes_read: 50 * 2 ** 20, bytes_total: 200 * 2 ** 20 };
    expect(describeModelStatus(halfway, 3)).toBe("Loading m… 25% of 200 MiB, 3 s");
    expect(describeModelStatus({ state: "failed", name: "m", error: "Bad config." })).toBe("Could not load m: Bad config.");
    expect(describeModelStatus({ state: "loaded", name: "m", path: "/m" })).toBe("Model: m");
  });
});

describe("decimalBytes and describeDownload", () => {
  it("use the Hub's decimal units", () => {
    expect(decimalBytes(999)).toBe("999 B");
    expect(decimalBytes(1_500)).toBe("1.5 kB");
    expect(decimalBytes(335_000_000)).toBe("335 MB");
    expect(decimalBytes(4_200_000_000)).toBe("4.2 GB");
  });

  it("say how far a download is", () => {
    expect(describeDownload({ bytes_done: 0, bytes_total: 0, files_done: 0, files_total: 0 })).toBe("Starting…");
    const done = { bytes_done: 2_000_000_000, bytes_total: 2_000_000_000, files_done: 5, files_total: 5 };
    expect(describeDownload(done)).toBe("100% of 2.0 GB (file 5 of 5)");
  });
});

describe("describeSampling", () => {
  it("names the samplers in use and where their values came from", () => {
    const params = { temperature: 0.6, top_p: 1, top_k: 20, min_p: 0, repetition_penalty: 0, seed: null };
    expect(describeSampling({ source: "model", params })).toBe("temperature 0.6, top-k 20 (the model's defaults)");
    expect(describeSampling({ source: "custom", params: { ...params, temperature: 0, repetition_penalty: 1.05, seed: 3 } }))
      .toBe("greedy, repetition penalty 1.05, seed 3 (this conversation's settings)");
    // XTC while sampling, OpenAI's penalties either way; XTC does nothing when greedy.
    const xtc = { ...params, xtc_probability: 0.5, xtc_threshold: 0.1, presence_penalty: 0.4, frequency_penalty: -0.2 };
    expect(describeSampling({ source: "custom", params: xtc }))
      .toBe("temperature 0.6, top-k 20, XTC 0.5 above 0.1, presence penalty 0.4, frequency penalty -0.2 (this conversation's settings)");
    expect(describeSampling({ source: "custom", params: { ...xtc, temperature: 0 } }))
      .toBe("greedy, presence penalty 0.4, frequency penalty -0.2 (this conversation's settings)");
  });
});
