import { describe, expect, it } from "vitest";
import { describeModelStatus, describeStats, mib } from "../src/format.js";

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
