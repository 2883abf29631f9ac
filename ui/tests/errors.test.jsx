import { describe, expect, it } from "vitest";
import { render } from "@testing-library/preact";
import { CommandError } from "../src/api.js";
import { ErrorMessage } from "../src/error-message.jsx";
import { describeError } from "../src/errors.js";

/** The element <ErrorMessage> draws for `error`. */
const shown = (error, as) => render(<ErrorMessage error={error} as={as} />).container.firstChild;

describe("errors in plain words", () => {
  it("says an unreachable Hub in one sentence, the raw error behind Details", () => {
    const raw = "cannot reach https://huggingface.co/api/models?search=qwen%203&author=mlx-community: io: failed to lookup address information.";
    const error = new CommandError({ kind: "network", message: raw });
    expect(describeError(error)).toEqual({
      sentence: "Perch can't reach the Hugging Face Hub. Check your internet connection, then try again.",
      detail: raw,
    });
    const element = shown(error);
    expect([element.tagName, element.className]).toEqual(["DIV", "error"]);
    expect(element.firstChild.textContent).not.toContain("https://");
    expect(element.querySelector("details").open).toBe(false);
    expect(element.querySelector("summary").textContent).toBe("Details");
    expect(element.querySelector("details code").textContent).toBe(raw);
    expect(shown(error, "span").tagName).toBe("SPAN");
  });

  it("says a full disk whatever the kind", () => {
    for (const message of [
      "storage: No space left on device (os error 28)",
      "Not enough disk space in /hf: the download needs 9 more bytes, 1 are free.",
    ]) {
      for (const kind of ["storage", "network", "internal"]) {
        expect(describeError(new CommandError({ kind, message })).sentence).toBe("The disk is full. Free some space, then try again.");
      }
    }
  });

  it("keeps sentences meant for the user as they are, without Details", () => {
    const fits = new CommandError({ kind: "invalid_model", message: "This model needs 9.1 GB and this Mac has 8 GB." });
    expect(describeError(fits)).toEqual({ sentence: "This model needs 9.1 GB and this Mac has 8 GB.", detail: null });
    expect(shown(fits).querySelector("details")).toBe(null);
    expect(shown(fits).textContent).toBe("This model needs 9.1 GB and this Mac has 8 GB.");
    expect(describeError("Cannot reach the server.")).toEqual({ sentence: "Cannot reach the server.", detail: null });
    // A request refused for memory: the engine's sentence (what it needs, what is free, what to do).
    const memory = "A prompt of 1241 tokens needs 174 MB of memory for its KV cache and 173 MB is available; shorten the prompt, close other apps or choose a smaller model.";
    expect(describeError(new CommandError({ kind: "out_of_memory", message: memory }))).toEqual({ sentence: memory, detail: null });
    expect(describeError(new Error("boom")).sentence).toBe("boom");
    expect(describeError(undefined).sentence).toBe("Unknown error.");
    expect(shown(undefined).textContent).toBe("Unknown error.");
  });

  it("gives the other technical kinds a sentence that says what to do", () => {
    for (const kind of ["storage", "overloaded", "internal"]) {
      const { sentence, detail } = describeError(new CommandError({ kind, message: "raw detail" }));
      expect(sentence).not.toBe("raw detail");
      expect(sentence).toMatch(/again|Perch/);
      expect(detail).toBe("raw detail");
    }
  });
});
