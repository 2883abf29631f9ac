import { describe, expect, it, vi } from "vitest";

vi.mock("@tauri-apps/api/core", () => ({
  invoke: vi.fn(async (command) => {
    if (command === "typed") throw { kind: "model_not_loaded", message: "No model is loaded." };
    if (command === "plain") throw "a plain string";
    return "ok";
  }),
  Channel: class {},
}));
vi.mock("@tauri-apps/api/event", () => ({ listen: vi.fn() }));

const { invoke, CommandError } = await import("../src/api.js");

describe("command errors", () => {
  it("arrive as CommandErrors with their kind, printed as their sentence", async () => {
    const error = await invoke("typed").catch((e) => e);
    expect(error).toBeInstanceOf(CommandError);
    expect(error.kind).toBe("model_not_loaded");
    expect(String(error)).toBe("No model is loaded.");
  });

  it("leave other rejections and answers as they are", async () => {
    await expect(invoke("plain")).rejects.toBe("a plain string");
    await expect(invoke("anything")).resolves.toBe("ok");
  });
});
