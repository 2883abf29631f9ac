// The chat view: the conversations list (search, new, rename, delete), the messages of the
// selected conversation, its settings, and the composer (send, Stop, regenerate, edit and resend
// the last user message). The history lives in Rust (SQLite); this view shows it and streams
// the answer being generated.

import { errorElement } from "./errors.js";
import { describeSampling, describeStats } from "./format.js";
import { renderMarkdown, copyText } from "./markdown.js";
import { showSamplingSource } from "./settings.js";
import { bindPresets } from "./presets.js";

/** Sampling fields of the conversation settings form: [name in SamplingParams, label, step]. */
const SAMPLING_FIELDS = [
  ["temperature", "Temperature", "0.05"],
  ["top_p", "Top-p", "0.05"],
  ["top_k", "Top-k", "1"],
  ["min_p", "Min-p", "0.01"],
  ["repetition_penalty", "Repetition penalty", "0.05"],
];

/** Sampling fields the conversation always sets itself, whichever the source (index.html). */
const OWN_SAMPLING_FIELDS = ["presence_penalty", "frequency_penalty", "xtc_probability", "xtc_threshold"];
/** The conversation's KV cache options (ConversationSettings' names; empty: none). */
const KV_FIELDS = ["max_kv_size", "kv_bits", "quantized_kv_start"];

export class ChatView {
  /** `root`: the element holding the chat view's markup (index.html); `api`: src/api.js. */
  constructor(root, api) {
    this.root = root;
    this.api = api;
    this.conversation = null; // what get_conversation returned
    this.running = null; // {requestId} while an answer streams
    this.editing = false;
    this.modelStatus = null; // the last model_status, for the model's sampling defaults
    const $ = (id) => root.querySelector(`#${id}`);
    this.el = {
      list: $("conversation-list"),
      search: $("search"),
      title: $("chat-title"),
      messages: $("messages"),
      input: $("input"),
      send: $("send"),
      stop: $("stop"),
      editing: $("editing"),
      settings: $("conversation-settings"),
      settingsError: $("conversation-settings-error"),
      error: $("chat-error"),
      notice: $("chat-notice"),
      sidebar: $("conversations"),
      rename: $("rename"),
      remove: $("delete"),
      empty: $("chat-empty"),
    };
    this.buildSettingsForm();
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.submit();
    });
    this.el.input.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.submit();
      } else if (event.key === "Escape" && this.running && !event.isComposing) {
        // Escape stops the answer being generated, as Stop does.
        event.preventDefault();
        this.stop();
      }
    });
    this.el.stop.addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => this.newConversation());
    $("cancel-edit").addEventListener("click", () => this.setEditing(false));
    $("toggle-conversations").addEventListener("click", () => this.setSidebar(!this.el.sidebar.classList.contains("open")));
    this.el.search.addEventListener("input", () => this.refreshList());
    this.el.rename.addEventListener("click", () => this.startRename());
    this.el.remove.addEventListener("click", () => this.confirmDelete());
    $("save-conversation-settings").addEventListener("click", () => this.saveSettings());
  }

  /** Opens or closes the conversations list over the chat (narrow windows), saying so to its button. */
  setSidebar(open) {
    this.el.sidebar.classList.toggle("open", open);
    this.root.querySelector("#toggle-conversations").setAttribute("aria-expanded", String(open));
  }

  /** Lists the conversations and opens the most recent one. */
  async init() {
    const list = await this.refreshList();
    if (list.length) await this.select(list[0].id);
    else this.render();
  }

  /** Shows `error` (a CommandError, an Error or a sentence) in plain words; `null` hides it. */
  showError(error) {
    this.el.error.replaceChildren(...(error ? [errorElement(this.root.ownerDocument, error, "span")] : []));
    this.el.error.hidden = !error;
  }

  /** A line about the answer being generated (e.g. older messages left out of its prompt). */
  showNotice(message) {
    this.el.notice.textContent = message ?? "";
    this.el.notice.hidden = !message;
  }

  async refreshList() {
    const list = await this.api.listConversations(this.el.search.value);
    this.el.list.replaceChildren(
      ...list.map((summary) => {
        const item = this.root.ownerDocument.createElement("li");
        const button = this.root.ownerDocument.createElement("button");
        button.type = "button";
        button.textContent = summary.title;
        button.dataset.id = summary.id;
        if (summary.id === this.conversation?.id) item.classList.add("current");
        button.addEventListener("click", () => {
          this.setSidebar(false);
          this.select(summary.id);
        });
        item.append(button);
        return item;
      }),
    );
    return list;
  }

  async select(id) {
    if (this.running) return; // one answer at a time: switching would hide the stream
    this.setEditing(false);
    this.showError(null);
    this.conversation = await this.api.getConversation(id);
    this.render();
    await this.refreshList();
  }

  async newConversation() {
    if (this.running) return;
    const summary = await this.api.createConversation();
    await this.select(summary.id);
    this.el.input.focus();
  }

  /** Draws the selected conversation (or an empty chat). */
  render() {
    const conversation = this.conversation;
    this.el.title.textContent = conversation?.title ?? "New chat";
    this.el.rename.disabled = this.el.remove.disabled = !conversation;
    this.fillSettingsForm(conversation?.settings);
    this.el.messages.replaceChildren();
    const messages = conversation?.messages ?? [];
    this.el.empty.hidden = messages.length > 0;
    const lastUser = messages.findLastIndex((m) => m.role === "user");
    messages.forEach((message, index) => {
      const { item } = this.addMessage(message.role, message.content);
      if (message.role === "assistant") {
        this.addMeta(item, message);
        if (index === messages.length - 1) this.addAction(item, "Regenerate", () => this.regenerate());
        this.addAction(item, "Copy", () => copyText(message.content, this.root.ownerDocument));
      } else if (index === lastUser) {
        this.addAction(item, "Edit", () => this.setEditing(true, message.content));
      }
    });
  }

  addMessage(role, text) {
    const doc = this.root.ownerDocument;
    const item = doc.createElement("li");
    item.className = role;
    const body = doc.createElement("div");
    body.className = "body";
    item.append(body);
    this.setBody(role, body, text);
    this.el.messages.append(item);
    this.el.empty.hidden = true;
    item.scrollIntoView?.({ block: "end" });
    return { item, body };
  }

  setBody(role, body, text) {
    // Answers are Markdown (sanitized); what the user typed is shown as typed.
    if (role === "assistant") renderMarkdown(body, text);
    else body.textContent = text;
  }

  addMeta(item, message) {
    const meta = this.root.ownerDocument.createElement("span");
    meta.className = "meta";
    meta.textContent = message.error ?? (message.stats ? describeStats(message.stats, message.finish_reason) : "");
    if (message.error) item.classList.add("error");
    item.append(meta);
    if (message.sampling) this.addSampling(item, message.sampling);
  }

  /** The sampling an answer is generated with (AnswerSampling), under it. */
  addSampling(item, sampling) {
    const line = this.root.ownerDocument.createElement("span");
    line.className = "sampling";
    line.textContent = describeSampling(sampling);
    item.append(line);
  }

  addAction(item, label, onClick) {
    const button = this.root.ownerDocument.createElement("button");
    button.type = "button";
    button.className = "action";
    button.textContent = label;
    button.disabled = this.running !== null;
    button.addEventListener("click", onClick);
    item.append(button);
  }

  setEditing(on, content = "") {
    this.editing = on;
    this.el.editing.hidden = !on;
    if (on) {
      this.el.input.value = content;
      this.el.input.focus();
    }
  }

  submit() {
    const text = this.el.input.value.trim();
    if (!text || this.running) return;
    this.el.input.value = "";
    const turn = this.editing ? { kind: "edit_last", content: text } : { kind: "send", content: text };
    this.setEditing(false);
    return this.startTurn(turn);
  }

  regenerate() {
    return this.startTurn({ kind: "regenerate" });
  }

  /**
   * Runs `turn`: the answer streams into a new message; when it is finished (and saved, see
   * commands/chat.rs) the conversation is read back from the history and drawn again.
   */
  async startTurn(turn) {
    this.showError(null);
    this.showNotice(null);
    if (!this.conversation) {
      const summary = await this.api.createConversation();
      this.conversation = await this.api.getConversation(summary.id);
    }
    const id = this.conversation.id;
    // Show the turn at once, as the history will have it.
    const messages = [...this.conversation.messages];
    const lastUser = messages.findLastIndex((m) => m.role === "user");
    if (turn.kind === "send") messages.push({ role: "user", content: turn.content });
    else {
      messages.splice(lastUser + 1);
      if (turn.kind === "edit_last") messages[lastUser] = { ...messages[lastUser], content: turn.content };
    }
    this.conversation = { ...this.conversation, messages };
    this.running = { requestId: null };
    this.render();
    const { item, body } = this.addMessage("assistant", "");
    item.classList.add("streaming");
    let answer = "";
    let drawPending = false;
    const finished = new Promise((resolve) => {
      this.onEvent = (event) => {
        if (event.event === "token") {
          answer += event.text;
          // Markdown is parsed at most once per frame, however fast tokens come.
          if (!drawPending) {
            drawPending = true;
            const draw = () => {
              drawPending = false;
              this.setBody("assistant", body, answer);
              item.scrollIntoView?.({ block: "end" });
            };
            const frame = this.root.ownerDocument.defaultView?.requestAnimationFrame;
            frame ? frame(draw) : draw();
          }
        } else if (event.event === "started") {
          this.addSampling(item, event.sampling);
        } else if (event.event === "context_trimmed") {
          const n = event.dropped_messages;
          this.showNotice(
            `This conversation is longer than the model's context: its first ${n} message${n === 1 ? "" : "s"} ` +
              "(after the system prompt) were left out of this answer. They stay in the history.",
          );
        } else if (event.event === "finished") {
          resolve(event);
        }
      };
    });
    this.el.send.disabled = true;
    try {
      this.running.requestId = await this.api.chat(id, turn, (event) => this.onEvent(event));
      this.el.stop.disabled = false;
      // The turn is in the history now: a first message also names the conversation.
      const list = await this.refreshList();
      const title = list.find((c) => c.id === id)?.title;
      if (title) this.el.title.textContent = title;
    } catch (error) {
      this.running = null;
      this.el.send.disabled = false;
      this.showError(error);
      this.conversation = await this.api.getConversation(id).catch(() => null);
      this.render();
      return;
    }
    const event = await finished;
    this.running = null;
    this.el.stop.disabled = true;
    this.el.send.disabled = false;
    if (event.save_error) this.showError(event.save_error);
    this.conversation = await this.api.getConversation(id);
    this.render();
    await this.refreshList();
  }

  /** Stops the answer being generated (the engine cancels it at once; the part shown is kept). */
  stop() {
    if (this.running?.requestId != null) return this.api.stop(this.running.requestId);
  }

  startRename() {
    if (!this.conversation) return;
    const doc = this.root.ownerDocument;
    const input = doc.createElement("input");
    input.value = this.conversation.title;
    input.className = "rename";
    const done = async (save) => {
      input.replaceWith(this.el.title);
      if (!save) return;
      try {
        const summary = await this.api.renameConversation(this.conversation.id, input.value);
        this.conversation = { ...this.conversation, title: summary.title };
        this.el.title.textContent = summary.title;
        await this.refreshList();
      } catch (error) {
        this.showError(error);
      }
    };
    input.addEventListener("keydown", (event) => {
      if (event.key === "Enter") done(true);
      if (event.key === "Escape") done(false);
    });
    input.addEventListener("blur", () => input.isConnected && done(true));
    this.el.title.replaceWith(input);
    input.focus();
  }

  /** Deletes after a second click on the same button within 3 s. */
  async confirmDelete() {
    if (!this.conversation || this.running) return;
    const button = this.el.remove;
    if (!button.classList.contains("confirm")) {
      button.classList.add("confirm");
      button.textContent = "Delete?";
      setTimeout(() => {
        button.classList.remove("confirm");
        button.textContent = "Delete";
      }, 3000);
      return;
    }
    button.classList.remove("confirm");
    button.textContent = "Delete";
    await this.api.deleteConversation(this.conversation.id);
    this.conversation = null;
    const list = await this.refreshList();
    if (list.length) await this.select(list[0].id);
    else this.render();
  }

  buildSettingsForm() {
    const doc = this.root.ownerDocument;
    const fields = this.el.settings.querySelector(".fields");
    for (const [name, label, step] of SAMPLING_FIELDS) {
      const wrapper = doc.createElement("label");
      wrapper.textContent = label;
      const input = doc.createElement("input");
      input.type = "number";
      input.step = step;
      input.min = "0";
      input.name = name;
      wrapper.append(input);
      fields.append(wrapper);
    }
    // The source select and its note come after the sampling fields, then the fields the
    // conversation sets whichever the source.
    const source = this.el.settings.querySelector("[name=sampling_source]");
    const preset = this.el.settings.querySelector("#conversation-preset");
    const note = this.el.settings.querySelector("#conversation-sampling-note");
    const own = OWN_SAMPLING_FIELDS.map((name) => this.el.settings.querySelector(`[name=${name}]`).closest("label"));
    this.el.settings.querySelector("[name=system_prompt]").closest("label").after(preset.closest("label"));
    fields.append(source.closest("label"), note, ...own);
    source.addEventListener("change", () => this.showSampling());
    this.showPreset = bindPresets(preset, source, () => this.samplingInputs(), () => this.showSampling(), undefined,
      () => this.conversation?.settings?.sampling);
  }

  /** [name, input] of the sampling fields that a preset or the model's defaults set. */
  samplingInputs() {
    return SAMPLING_FIELDS.map(([name]) => [name, this.el.settings.querySelector(`[name=${name}]`)]);
  }

  /** The sampling inputs follow the source select (read-only model defaults, or custom). */
  showSampling() {
    const form = this.el.settings;
    const source = form.querySelector("[name=sampling_source]").value;
    showSamplingSource(source, this.samplingInputs(), form.querySelector("#conversation-sampling-note"), this.modelStatus);
    this.showPreset?.();
  }

  /** The model's status (main.js passes each one it reads): its sampling defaults are shown. */
  setModelStatus(status) {
    this.modelStatus = status;
    this.showSampling();
  }

  fillSettingsForm(settings) {
    const form = this.el.settings;
    form.querySelector("[name=system_prompt]").value = settings?.system_prompt ?? "";
    form.querySelector("[name=max_tokens]").value = settings?.max_tokens ?? "";
    for (const name of KV_FIELDS) form.querySelector(`[name=${name}]`).value = settings?.[name] ?? "";
    form.querySelector("[name=seed]").value = settings?.sampling?.seed ?? "";
    form.querySelector("[name=sampling_source]").value = settings?.sampling_source ?? "model";
    for (const name of [...SAMPLING_FIELDS.map(([name]) => name), ...OWN_SAMPLING_FIELDS]) {
      form.querySelector(`[name=${name}]`).value = settings?.sampling?.[name] ?? "";
    }
    this.showSampling();
    this.el.settingsError.textContent = "";
  }

  /** Reads the form into ConversationSettings, keeping fields the form does not show. */
  readSettingsForm() {
    const form = this.el.settings;
    const value = (name) => form.querySelector(`[name=${name}]`).value;
    const sampling = { ...this.conversation.settings.sampling };
    // Values shown read-only from the model are not saved as the conversation's own.
    for (const [name] of SAMPLING_FIELDS) {
      if (!form.querySelector(`[name=${name}]`).disabled) sampling[name] = Number(value(name));
    }
    for (const name of OWN_SAMPLING_FIELDS) {
      if (value(name) !== "") sampling[name] = Number(value(name));
    }
    sampling.seed = value("seed") === "" ? null : Number(value("seed"));
    const optional = (name) => (value(name) === "" ? null : Number(value(name)));
    return {
      ...this.conversation.settings,
      sampling_source: value("sampling_source"),
      system_prompt: value("system_prompt"),
      max_tokens: Number(value("max_tokens")),
      max_kv_size: optional("max_kv_size"),
      kv_bits: optional("kv_bits"),
      quantized_kv_start: optional("quantized_kv_start") ?? this.conversation.settings.quantized_kv_start,
      sampling,
    };
  }

  async saveSettings() {
    if (!this.conversation) return;
    const settings = this.readSettingsForm();
    try {
      await this.api.setConversationSettings(this.conversation.id, settings);
      this.conversation = { ...this.conversation, settings };
      this.el.settingsError.textContent = "Saved.";
    } catch (error) {
      this.el.settingsError.textContent = String(error);
    }
  }
}
