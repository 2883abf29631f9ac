import { beforeEach, describe, expect, it, vi } from "vitest";
import { createRef } from "preact";
import { act, fireEvent, render } from "@testing-library/preact";
import { ChatView } from "../src/chat.jsx";

const settings = { system_prompt: "", sampling_source: "model", sampling: { temperature: 0, top_p: 0, top_k: 0, min_p: 0, repetition_penalty: 0, logit_bias: {}, seed: null }, max_tokens: 1024 };
const stats = { prompt_tokens: 20, cached_prompt_tokens: 16, generation_tokens: 3, generation_tps: 9, ttft_s: 0.1, prompt_tps: 1, total_s: 1, peak_memory_bytes: 0 };

/** An in-memory stand-in for the Rust commands, with the history's turn rules. */
function fakeApi() {
  const conversations = new Map();
  let nextId = 1;
  const api = {
    calls: [],
    listConversations: vi.fn(async (search) =>
      [...conversations.values()]
        .filter((c) => !search || c.title.toLowerCase().includes(search.toLowerCase()))
        .map(({ id, title }) => ({ id, title })),
    ),
    createConversation: vi.fn(async () => {
      const c = { id: nextId++, title: "New chat", settings, messages: [] };
      conversations.set(c.id, c);
      return { id: c.id, title: c.title };
    }),
    getConversation: vi.fn(async (id) => structuredClone(conversations.get(id))),
    deleteConversation: vi.fn(async (id) => conversations.delete(id)),
    renameConversation: vi.fn(async (id, title) => {
      conversations.get(id).title = title.trim();
      return { id, title: title.trim() };
    }),
    setConversationSettings: vi.fn(async (id, s) => (conversations.get(id).settings = s)),
    stop: vi.fn(async () => {}),
    chat: vi.fn(async (id, turn, onEvent) => {
      const c = conversations.get(id);
      const lastUser = c.messages.findLastIndex((m) => m.role === "user");
      if (turn.kind === "send") {
        const images = (turn.images ?? []).map((i) => `data:${i.media_type};base64,${i.data}`);
        c.messages.push({ id: nextId++, role: "user", content: turn.content, images });
      }
      else {
        c.messages.splice(lastUser + 1);
        if (turn.kind === "edit_last") c.messages[lastUser].content = turn.content;
      }
      if (c.title === "New chat") c.title = c.messages[0].content;
      api.stream = {
        trimmed: (dropped_messages) => onEvent({ event: "context_trimmed", dropped_messages }),
        started: (sampling) => {
          api.sampling = sampling;
          onEvent({ event: "started", sampling });
        },
        token: (text) => onEvent({ event: "token", text }),
        finish: (content, finish_reason = "stop") => {
          const sampling = api.sampling ?? null;
          c.messages.push({ id: nextId++, role: "assistant", content, finish_reason, stats, error: null, sampling });
          onEvent({ event: "finished", finish_reason, stats, error: null, message_id: nextId - 1, save_error: null });
        },
      };
      return 7;
    }),
  };
  return api;
}

const tick = () => new Promise((resolve) => setTimeout(resolve, 30));
const $ = (id) => document.getElementById(id);
const texts = (selector) => [...document.querySelectorAll(selector)].map((e) => e.textContent.trim());

let api;
let handle;
/** Shows model_status `status` to the view, as app.jsx passes each one it reads. */
let showStatus;
beforeEach(async () => {
  api = fakeApi();
  handle = createRef();
  const { rerender } = render(<ChatView api={api} status={null} visible handle={handle} />);
  showStatus = (status) => rerender(<ChatView api={api} status={status} visible handle={handle} />);
  await act(tick);
});

/** Sends `text` from the composer; resolves once the turn has started. */
async function type(text) {
  $("input").value = text;
  $("send").click();
  await tick();
}

/** Waits for the turn to end: the answer saved, drawn and the list read again. */
async function done() {
  await vi.waitFor(() => expect(document.querySelector("#messages li.streaming")).toBe(null));
  await tick();
}

const newConversation = () => act(() => handle.current.newConversation());

describe("ChatView", () => {
  it("streams an answer as Markdown, then shows the saved answer with its stats", async () => {
    await type("Hello?");
    expect(api.chat).toHaveBeenCalledWith(1, { kind: "send", content: "Hello?" }, expect.any(Function));
    expect($("input").value).toBe("");
    expect(texts("#messages li.user .body")).toEqual(["Hello?"]);
    expect($("chat-title").textContent).toBe("Hello?"); // named while the answer streams
    expect($("send").disabled).toBe(true);
    expect($("stop").disabled).toBe(false);
    api.stream.token("Hi **the");
    api.stream.token("re**");
    await tick();
    expect(document.querySelector("#messages li.assistant.streaming strong").textContent).toBe("there");
    api.stream.finish("Hi **there**");
    await done();
    expect(document.querySelector("#messages li.streaming")).toBe(null);
    expect(texts("#messages li.assistant .meta")).toEqual(["3 tokens · TTFT 100 ms · 9.0 tok/s · 16 of 20 prompt tokens cached"]);
    expect(texts("#conversation-list button")).toEqual(["Hello?"]);
    expect(document.querySelector("#conversation-list li.current button").textContent).toBe("Hello?");
    expect($("send").disabled).toBe(false);
    expect($("stop").disabled).toBe(true);
  });

  it("drops the streamed answer when the saved one cannot be read back, and says why", async () => {
    await type("Hello?");
    api.stream.token("Hi");
    await tick();
    api.getConversation.mockImplementationOnce(async () => {
      throw "The history cannot be read.";
    });
    api.stream.finish("Hi");
    await done();
    expect($("chat-error").textContent).toContain("The history cannot be read.");
    // A new chat starts empty: nothing of the earlier stream is carried over.
    await newConversation();
    await tick();
    expect(document.querySelectorAll("#messages > li").length).toBe(0);
    expect($("chat-empty").hidden).toBe(false);
  });

  it("an earlier answer loses Regenerate once a later one follows (messages redraw when their actions change)", async () => {
    await type("Hello?");
    api.stream.finish("First answer");
    await done();
    const buttons = (li) => [...li.querySelectorAll("button")].map((b) => b.textContent.trim());
    expect(buttons(document.querySelectorAll("#messages li.assistant")[0])).toContain("Regenerate");
    await type("Again?");
    api.stream.token("Second");
    await tick();
    api.stream.finish("Second answer");
    await done();
    const answers = document.querySelectorAll("#messages li.assistant");
    expect(buttons(answers[0])).not.toContain("Regenerate");
    expect(buttons(answers[1])).toContain("Regenerate");
  });

  it("sends with Enter, and Shift+Enter does not", async () => {
    $("input").value = "Line one";
    fireEvent.keyDown($("input"), { key: "Enter", shiftKey: true });
    expect(api.chat).not.toHaveBeenCalled();
    fireEvent.keyDown($("input"), { key: "Enter" });
    await tick();
    expect(api.chat).toHaveBeenCalledWith(1, { kind: "send", content: "Line one" }, expect.any(Function));
    api.stream.finish("Ok.");
    await done();
  });

  it("says when a long conversation's oldest messages were left out, until the next turn", async () => {
    await type("A long chat.");
    expect($("chat-notice").hidden).toBe(true);
    api.stream.trimmed(4);
    api.stream.token("Sure.");
    await tick();
    expect($("chat-notice").hidden).toBe(false);
    expect($("chat-notice").textContent).toMatch(/first 4 messages .* left out of this answer/);
    api.stream.finish("Sure.");
    await done();
    expect($("chat-notice").hidden).toBe(false); // still there with the answer it explains
    await type("Short again.");
    expect($("chat-notice").hidden).toBe(true);
    api.stream.finish("Yes.");
    await done();
  });

  it("Stop cancels the running request by its id", async () => {
    await type("Count to 500.");
    api.stream.token("1, 2");
    $("stop").click();
    expect(api.stop).toHaveBeenCalledWith(7);
    api.stream.finish("1, 2", "cancelled");
    await done();
    expect(texts("#messages li.assistant .meta")[0]).toMatch(/stopped$/);
  });

  it("Escape in the composer stops the answer being generated", async () => {
    await type("Count to 500.");
    api.stream.token("1, 2");
    $("input").dispatchEvent(new KeyboardEvent("keydown", { key: "Escape", bubbles: true }));
    expect(api.stop).toHaveBeenCalledWith(7);
    api.stream.finish("1, 2", "cancelled");
    await done();
    // With nothing generating, Escape does nothing.
    $("input").dispatchEvent(new KeyboardEvent("keydown", { key: "Escape", bubbles: true }));
    expect(api.stop).toHaveBeenCalledTimes(1);
  });

  it("regenerates the last answer and edits the last user message", async () => {
    await type("First");
    api.stream.finish("A1");
    await done();
    const regenerate = [...document.querySelectorAll("#messages li.assistant .action")].find((b) => b.textContent === "Regenerate");
    regenerate.click();
    await tick();
    expect(api.chat).toHaveBeenLastCalledWith(1, { kind: "regenerate" }, expect.any(Function));
    expect(texts("#messages li.assistant .body")).toEqual([""]);
    // While it generates, the messages' actions are off.
    expect([...document.querySelectorAll("#messages .action")].every((b) => b.disabled)).toBe(true);
    api.stream.finish("A2");
    await done();
    expect(texts("#messages li .body")).toEqual(["First", "A2"]);

    const edit = [...document.querySelectorAll("#messages li.user .action")].find((b) => b.textContent === "Edit");
    fireEvent.click(edit);
    expect($("input").value).toBe("First");
    expect($("editing").hidden).toBe(false);
    await type("First, edited");
    expect(api.chat).toHaveBeenLastCalledWith(1, { kind: "edit_last", content: "First, edited" }, expect.any(Function));
    expect($("editing").hidden).toBe(true);
    api.stream.finish("A3");
    await done();
    expect(texts("#messages li .body")).toEqual(["First, edited", "A3"]);

    // Cancel leaves editing: the next message is sent as a new one.
    fireEvent.click([...document.querySelectorAll("#messages li.user .action")].find((b) => b.textContent === "Edit"));
    fireEvent.click($("cancel-edit"));
    expect($("editing").hidden).toBe(true);
    await type("Second");
    expect(api.chat).toHaveBeenLastCalledWith(1, { kind: "send", content: "Second" }, expect.any(Function));
    api.stream.finish("A4");
    await done();
  });

  it("copies an answer", async () => {
    const writeText = vi.fn().mockResolvedValue(undefined);
    Object.defineProperty(window.navigator, "clipboard", { value: { writeText }, configurable: true });
    await type("Hi");
    api.stream.finish("Hello **you**");
    await done();
    [...document.querySelectorAll("#messages li.assistant .action")].find((b) => b.textContent === "Copy").click();
    expect(writeText).toHaveBeenCalledWith("Hello **you**");
  });

  it("searches, switches and deletes conversations (delete asks twice)", async () => {
    await type("About cats");
    api.stream.finish("Meow");
    await done();
    await newConversation();
    await type("About dogs");
    api.stream.finish("Woof");
    await done();
    expect(texts("#conversation-list button")).toEqual(["About cats", "About dogs"]);
    $("search").value = "cat";
    $("search").dispatchEvent(new Event("input"));
    await tick();
    expect(api.listConversations).toHaveBeenLastCalledWith("cat");
    expect(texts("#conversation-list button")).toEqual(["About cats"]);
    document.querySelector("#conversation-list button").click();
    await tick();
    expect(texts("#messages li .body")).toEqual(["About cats", "Meow"]);
    fireEvent.click($("delete"));
    expect(api.deleteConversation).not.toHaveBeenCalled();
    expect([$("delete").textContent, $("delete").classList.contains("confirm")]).toEqual(["Delete?", true]);
    fireEvent.click($("delete"));
    await tick();
    expect(api.deleteConversation).toHaveBeenCalledWith(1);
    expect($("delete").textContent).toBe("Delete");
  });

  it("renames the conversation in place: Enter saves, Escape cancels", async () => {
    await type("Old title");
    api.stream.finish("Ok.");
    await done();
    fireEvent.click($("rename"));
    const field = document.querySelector(".chat-header input.rename");
    expect($("chat-title")).toBe(null);
    expect([field.value, document.activeElement]).toEqual(["Old title", field]);
    field.value = "New title";
    fireEvent.keyDown(field, { key: "Enter" });
    await tick();
    expect(api.renameConversation).toHaveBeenCalledTimes(1);
    expect(api.renameConversation).toHaveBeenCalledWith(1, "New title");
    expect($("chat-title").textContent).toBe("New title");
    expect(texts("#conversation-list button")).toEqual(["New title"]);
    fireEvent.click($("rename"));
    document.querySelector("input.rename").value = "Not this";
    fireEvent.keyDown(document.querySelector("input.rename"), { key: "Escape" });
    await tick();
    expect(api.renameConversation).toHaveBeenCalledTimes(1);
    expect($("chat-title").textContent).toBe("New title");
  });

  it("saves the conversation's settings from its form", async () => {
    await newConversation();
    const form = $("conversation-settings");
    form.querySelector("[name=sampling_source]").value = "custom";
    form.querySelector("[name=sampling_source]").dispatchEvent(new Event("change"));
    form.querySelector("[name=system_prompt]").value = "Be brief.";
    form.querySelector("[name=temperature]").value = "0.7";
    form.querySelector("[name=seed]").value = "42";
    form.querySelector("[name=presence_penalty]").value = "0.5";
    form.querySelector("[name=xtc_probability]").value = "0.3";
    form.querySelector("[name=xtc_threshold]").value = "0.12";
    form.querySelector("[name=kv_bits]").value = "8";
    form.querySelector("[name=quantized_kv_start]").value = "256";
    $("save-conversation-settings").click();
    await tick();
    const [id, saved] = api.setConversationSettings.mock.calls[0];
    expect(id).toBe(1);
    expect(saved).toMatchObject({ system_prompt: "Be brief.", max_tokens: 1024, sampling_source: "custom",
      max_kv_size: null, kv_bits: 8, quantized_kv_start: 256,
      sampling: { temperature: 0.7, seed: 42, top_k: 0, logit_bias: {}, presence_penalty: 0.5, xtc_probability: 0.3, xtc_threshold: 0.12 } });
    expect($("conversation-settings-error").textContent).toBe("Saved.");
    // The form shows what was saved.
    expect([form.querySelector("[name=temperature]").value, form.querySelector("[name=system_prompt]").value]).toEqual(["0.7", "Be brief."]);
    // Another conversation's form says nothing about it.
    await newConversation();
    expect($("conversation-settings-error").textContent).toBe("");
    expect(form.querySelector("[name=system_prompt]").value).toBe("");
  });

  it("sets the conversation's sampling from a preset", async () => {
    await newConversation();
    const form = $("conversation-settings");
    const preset = $("conversation-preset");
    expect(preset.value).toBe("model");
    preset.value = "precise";
    fireEvent.change(preset);
    expect(form.querySelector("[name=sampling_source]").value).toBe("custom");
    expect(form.querySelector("[name=temperature]").disabled).toBe(false);
    $("save-conversation-settings").click();
    await tick();
    expect(api.setConversationSettings.mock.calls[0][1]).toMatchObject({ sampling_source: "custom",
      sampling: { temperature: 0.2, top_p: 0.9, top_k: 40, min_p: 0.05, repetition_penalty: 1 } });
    form.querySelector("[name=top_k]").value = "0";
    fireEvent.input(form.querySelector("[name=top_k]"));
    expect(preset.value).toBe("custom");
  });

  it("shows the model's sampling defaults read-only while the conversation follows the model", async () => {
    await newConversation();
    const form = $("conversation-settings");
    const field = (name) => form.querySelector(`[name=${name}]`);
    showStatus({ state: "loaded", name: "Qwen3-0.6B", path: "/m",
      sampling_defaults: { temperature: 0.6, top_p: 0.95, top_k: 20, min_p: 0, repetition_penalty: 0, repetition_context_size: 64, source: "model" } });
    expect(field("sampling_source").value).toBe("model");
    expect([field("temperature").disabled, field("temperature").value, field("top_k").value]).toEqual([true, "0.6", "20"]);
    expect($("conversation-sampling-note").textContent).toBe("From Qwen3-0.6B's generation_config.json.");
    // Penalties and XTC are the conversation's own whichever the source.
    expect(field("frequency_penalty").disabled).toBe(false);
    field("frequency_penalty").value = "0.25";
    // Saved while following the model: the conversation's own values are kept, not the model's.
    $("save-conversation-settings").click();
    await tick();
    expect(api.setConversationSettings.mock.calls[0][1]).toMatchObject({ sampling_source: "model", sampling: { temperature: 0, top_k: 0, frequency_penalty: 0.25 } });
    // Still showing the model's values after the save.
    expect([field("temperature").disabled, field("temperature").value]).toEqual([true, "0.6"]);
    // A model without sampling in its generation_config.json: Perch's defaults, said so.
    showStatus({ state: "loaded", name: "SmolLM2", path: "/m",
      sampling_defaults: { temperature: 0.8, top_p: 0.95, top_k: 40, min_p: 0.05, repetition_penalty: 1.1, repetition_context_size: 64, source: "perch" } });
    expect(field("temperature").value).toBe("0.8");
    expect($("conversation-sampling-note").textContent).toBe("Perch's defaults: SmolLM2's generation_config.json names none.");
    // Custom starts from the values shown, and they can be changed.
    field("sampling_source").value = "custom";
    fireEvent.change(field("sampling_source"));
    expect([field("temperature").disabled, field("temperature").value]).toEqual([false, "0.8"]);
    expect($("conversation-sampling-note").textContent).toBe("");
  });

  it("saves custom greedy sampling set in one script, before any redraw (as the end-to-end test does)", async () => {
    await newConversation();
    showStatus({ state: "loaded", name: "SmolLM2", path: "/m",
      sampling_defaults: { temperature: 0.8, top_p: 0.95, top_k: 40, min_p: 0.05, repetition_penalty: 1.1, repetition_context_size: 64, source: "perch" } });
    const f = $("conversation-settings");
    f.open = true;
    const source = f.querySelector("[name=sampling_source]");
    source.value = "custom";
    source.dispatchEvent(new Event("change"));
    f.querySelector("[name=temperature]").value = "0";
    f.querySelector("[name=repetition_penalty]").value = "0";
    $("save-conversation-settings").click();
    f.open = false;
    await tick();
    expect($("conversation-settings-error").textContent).toBe("Saved.");
    expect(api.setConversationSettings.mock.calls[0][1]).toMatchObject({ sampling_source: "custom",
      sampling: { temperature: 0, repetition_penalty: 0, top_p: 0.95, top_k: 40 } });
  });

  it("shows the sampling an answer is generated with while it streams and once saved", async () => {
    await type("A poem, please.");
    const sampling = { source: "perch",
      params: { temperature: 0.800000011920929, top_p: 0.95, top_k: 40, min_p: 0.05, repetition_penalty: 1.1, seed: null } };
    api.stream.started(sampling);
    api.stream.token("Waves");
    await tick();
    const line = "temperature 0.8, top-p 0.95, top-k 40, min-p 0.05, repetition penalty 1.1 (Perch's defaults)";
    expect(texts("#messages li.assistant.streaming .sampling")).toEqual([line]);
    api.stream.finish("Waves");
    await done();
    expect(texts("#messages li.assistant .sampling")).toEqual([line]);
  });

  it("shows a refused turn's error and keeps the composer usable", async () => {
    api.chat.mockRejectedValueOnce("No model is loaded; choose one under Models.");
    await type("Hi");
    expect($("chat-error").hidden).toBe(false);
    expect($("chat-error").textContent).toBe("No model is loaded; choose one under Models.");
    expect(document.querySelector("#messages li.streaming")).toBe(null);
    expect($("send").disabled).toBe(false);
  });

  it("shows an empty state until the conversation has a message", async () => {
    expect($("chat-empty").hidden).toBe(false);
    await type("Hi");
    expect($("chat-empty").hidden).toBe(true);
    api.stream.finish("Hello.");
    await done();
    expect($("chat-empty").hidden).toBe(true);
  });

  it("opens the most recent conversation at start", async () => {
    await type("Earlier");
    api.stream.finish("Yes.");
    await done();
    const again = createRef();
    render(<ChatView api={api} status={null} visible={false} handle={again} />);
    await act(tick);
    const views = document.querySelectorAll("#view-chat");
    expect(views[1].hidden).toBe(true);
    expect([...views[1].querySelectorAll("#messages li .body")].map((b) => b.textContent.trim())).toEqual(["Earlier", "Yes."]);
  });

  it("the conversations button says whether the list is open", async () => {
    await newConversation();
    const toggle = $("toggle-conversations");
    fireEvent.click(toggle);
    expect(toggle.getAttribute("aria-expanded")).toBe("true");
    expect($("conversations").classList.contains("open")).toBe(true);
    fireEvent.click(document.querySelector("#conversation-list button"));
    expect(toggle.getAttribute("aria-expanded")).toBe("false");
    expect($("conversations").classList.contains("open")).toBe(false);
  });

  describe("images", () => {
    const png = (name = "cat.png") => new File([new Uint8Array([0x89, 0x50, 0x4e, 0x47, 1, 2, 3])], name, { type: "image/png" });
    const pick = async (...files) => {
      Object.defineProperty($("attach-file"), "files", { value: files, configurable: true });
      fireEvent.change($("attach-file"));
      await vi.waitFor(() => expect(document.querySelectorAll("#attachments img").length).toBeGreaterThan(0));
    };

    it("attaches picked images as thumbnails and sends them with the message", async () => {
      showStatus({ state: "loaded", name: "Gemma 3", vision: true });
      await pick(png("a.png"), png("b.png"));
      expect([...document.querySelectorAll("#attachments img")].map((i) => i.alt)).toEqual(["a.png", "b.png"]);
      // One removed before sending.
      fireEvent.click(document.querySelector('#attachments button[aria-label="Remove a.png"]'));
      expect([...document.querySelectorAll("#attachments img")].map((i) => i.alt)).toEqual(["b.png"]);
      await type("What is this?");
      const data = btoa(String.fromCharCode(0x89, 0x50, 0x4e, 0x47, 1, 2, 3));
      expect(api.chat).toHaveBeenCalledWith(
        1,
        { kind: "send", content: "What is this?", images: [{ media_type: "image/png", data }] },
        expect.any(Function),
      );
      expect($("attachments")).toBe(null);
      expect([...document.querySelectorAll("#messages li.user .images img")].map((i) => i.src)).toEqual([`data:image/png;base64,${data}`]);
      api.stream.finish("A cat.");
      await done();
      // Saved, the message keeps its image.
      expect(document.querySelectorAll("#messages li.user .images img").length).toBe(1);
    });

    it("takes a pasted or dropped image, and sends an image alone", async () => {
      showStatus({ state: "loaded", name: "Gemma 3", vision: true });
      fireEvent.paste($("input"), { clipboardData: { files: [png("pasted.png")] } });
      await vi.waitFor(() => expect(document.querySelectorAll("#attachments img").length).toBe(1));
      fireEvent.drop($("composer"), { dataTransfer: { files: [png("dropped.png")], types: ["Files"] } });
      await vi.waitFor(() => expect(document.querySelectorAll("#attachments img").length).toBe(2));
      await type("");
      expect(api.chat.mock.calls[0][1].images.length).toBe(2);
      expect(api.chat.mock.calls[0][1].content).toBe("");
    });

    it("gives a refused turn's images back to the composer", async () => {
      showStatus({ state: "loaded", name: "Gemma 3", vision: true });
      api.chat.mockImplementationOnce(async () => {
        throw new Error("The image is damaged.");
      });
      await pick(png("photo.png"));
      await type("Look");
      await vi.waitFor(() => expect($("chat-error").textContent).toContain("The image is damaged."));
      expect([...document.querySelectorAll("#attachments img")].map((i) => i.alt)).toEqual(["photo.png"]);
    });

    it("says when the loaded model takes no images, and refuses other files", async () => {
      showStatus({ state: "loaded", name: "SmolLM2", vision: false });
      await pick(png());
      expect($("attach-note").hidden).toBe(false);
      expect($("attach-note").textContent).toContain("SmolLM2 takes no images");
      expect($("send").disabled).toBe(true);
      fireEvent.click(document.querySelector('#attachments button[aria-label="Remove cat.png"]'));
      expect($("attach-note").hidden).toBe(true);
      expect($("send").disabled).toBe(false);
      Object.defineProperty($("attach-file"), "files", {
        value: [new File(["BM"], "old.bmp", { type: "image/bmp" })],
        configurable: true,
      });
      fireEvent.change($("attach-file"));
      await tick();
      expect($("chat-error").textContent).toContain("old.bmp is not a PNG, JPEG, WebP or GIF image.");
      expect($("attachments")).toBe(null);
    });
  });
});