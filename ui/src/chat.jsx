// The chat view: the conversations list (search, new, rename, delete), the messages of the
// selected conversation, its settings, and the composer (send, Stop, regenerate, edit and resend
// the last user message). The history lives in Rust (SQLite); this view shows it and streams
// the answer being generated.

import { Component } from "preact";
import { useEffect, useImperativeHandle, useLayoutEffect, useRef, useState } from "preact/hooks";
import { ErrorMessage } from "./error-message.jsx";
import { SAMPLING_DEFAULT_FIELDS } from "./form.js";
import { describeSampling, describeStats } from "./format.js";
import { useConfirm } from "./hooks.js";
import { Icon } from "./icons.jsx";
import { copyText } from "./markdown.js";
import { Markdown } from "./markdown-view.jsx";
import { PRESET_CHOICES } from "./presets.js";
import { useSampling } from "./sampling.js";

/** Sampling fields of the conversation settings form: [name in SamplingParams, label, step]. */
const SAMPLING_FIELDS = [
  ["temperature", "Temperature", "0.05"],
  ["top_p", "Top-p", "0.05"],
  ["top_k", "Top-k", "1"],
  ["min_p", "Min-p", "0.01"],
  ["repetition_penalty", "Repetition penalty", "0.05"],
];

/** Sampling fields the conversation always sets itself, whichever the source. */
const OWN_SAMPLING_FIELDS = ["presence_penalty", "frequency_penalty", "xtc_probability", "xtc_threshold"];
/** The conversation's KV cache options (ConversationSettings' names; empty: none). */
const KV_FIELDS = ["max_kv_size", "kv_bits", "quantized_kv_start"];

/**
 * The conversation's settings (a <details> under the header): `conversation` is the selected one
 * (or null); its form is filled whenever its settings are read from the history again; `status`
 * is the last model_status (its sampling defaults); `onSaved(settings)` is told what was saved.
 * The inputs hold the values (the end-to-end test and users alike edit them), read when saved.
 */
function ConversationSettings({ api, conversation, status, onSaved }) {
  const form = useRef(null);
  // The answer to the last save, shown while the form shows the settings it was about.
  const [said, setSaid] = useState(null);
  const sampling = useSampling({ status, saved: () => conversation?.settings?.sampling });
  const settings = conversation?.settings;
  const field = (name) => form.current.querySelector(`[name=${name}]`);

  useLayoutEffect(() => {
    field("system_prompt").value = settings?.system_prompt ?? "";
    field("max_tokens").value = settings?.max_tokens ?? "";
    for (const name of KV_FIELDS) field(name).value = settings?.[name] ?? "";
    field("seed").value = settings?.sampling?.seed ?? "";
    for (const name of [...SAMPLING_DEFAULT_FIELDS, ...OWN_SAMPLING_FIELDS]) field(name).value = settings?.sampling?.[name] ?? "";
    field("sampling_source").value = settings?.sampling_source ?? "model";
    sampling.filled(settings?.sampling_source ?? "model");
  }, [settings]);

  /** Reads the form into ConversationSettings, keeping fields the form does not show. */
  function read(base) {
    const value = (name) => field(name).value;
    const sampled = { ...base.sampling };
    // Values shown read-only from the model are not saved as the conversation's own.
    if (value("sampling_source") !== "model") {
      for (const name of SAMPLING_DEFAULT_FIELDS) sampled[name] = Number(value(name));
    }
    for (const name of OWN_SAMPLING_FIELDS) {
      if (value(name) !== "") sampled[name] = Number(value(name));
    }
    sampled.seed = value("seed") === "" ? null : Number(value("seed"));
    const optional = (name) => (value(name) === "" ? null : Number(value(name)));
    return {
      ...base,
      sampling_source: value("sampling_source"),
      system_prompt: value("system_prompt"),
      max_tokens: Number(value("max_tokens")),
      max_kv_size: optional("max_kv_size"),
      kv_bits: optional("kv_bits"),
      quantized_kv_start: optional("quantized_kv_start") ?? base.quantized_kv_start,
      sampling: sampled,
    };
  }

  async function save() {
    if (!conversation) return;
    const next = read(conversation.settings);
    try {
      await api.setConversationSettings(conversation.id, next);
      onSaved(next);
      setSaid({ text: "Saved.", about: next });
    } catch (error) {
      setSaid({ text: String(error), about: conversation.settings });
    }
  }

  const own = (name) => ({ ref: sampling.refs[name], disabled: sampling.source === "model", onInput: sampling.onFieldInput });
  return (
    <details id="conversation-settings" ref={form}>
      <summary>Conversation settings</summary>
      <div class="fields">
        <label class="wide">System prompt <textarea name="system_prompt" rows="2"></textarea></label>
        <label>Sampling
          <select id="conversation-preset" aria-describedby="conversation-sampling-note" value={sampling.choice} onChange={sampling.onPresetChange}>
            {PRESET_CHOICES.map(([value, label]) => <option value={value}>{label}</option>)}
          </select>
        </label>
        <label>Max tokens <input type="number" name="max_tokens" min="1" step="1" /></label>
        <label>Seed <input type="number" name="seed" min="0" step="1" placeholder="random" /></label>
        <label>KV cache limit (tokens) <input type="number" name="max_kv_size" min="5" step="1" placeholder="none" /></label>
        <label>KV cache bits <select name="kv_bits"><option value="">full precision</option><option>8</option><option>4</option></select></label>
        <label>Quantize KV after (tokens) <input type="number" name="quantized_kv_start" min="0" step="1" /></label>
        {SAMPLING_FIELDS.map(([name, label, step]) => (
          <label>{label}<input type="number" step={step} min="0" name={name} {...own(name)} /></label>
        ))}
        <label>Source
          <select name="sampling_source" class="sampling-source" value={sampling.source} onChange={sampling.onSourceChange}>
            <option value="model">The model's defaults</option><option value="custom">Custom</option>
          </select>
        </label>
        <p class="wide sampling-note" id="conversation-sampling-note">{sampling.note}</p>
        <label>Presence penalty <input type="number" name="presence_penalty" min="-2" max="2" step="0.1" /></label>
        <label>Frequency penalty <input type="number" name="frequency_penalty" min="-2" max="2" step="0.1" /></label>
        <label>XTC probability <input type="number" name="xtc_probability" min="0" max="1" step="0.05" /></label>
        <label>XTC threshold <input type="number" name="xtc_threshold" min="0" max="0.5" step="0.01" /></label>
      </div>
      <button type="button" id="save-conversation-settings" onClick={save}>Save</button>
      <span id="conversation-settings-error">{said && said.about === settings ? said.text : ""}</span>
    </details>
  );
}

/** A message of the history: its body, an answer's stats and sampling, and its actions. */
/** A message, redrawn only when it, the running flag or its actions' labels change (a streamed
 * frame redraws the view, not every message); the actions' handlers read refs, so an older
 * render's are as good. */
class Message extends Component {
  shouldComponentUpdate(next) {
    const labels = (actions) => actions.map(([label]) => label).join("\n");
    const { message, running, actions } = this.props;
    return next.message !== message || next.running !== running || labels(next.actions) !== labels(actions);
  }

  render(props) {
    return <MessageItem {...props} />;
  }
}

/** What the composer attaches: the formats the engine reads, up to 16 images of 20 MB each. */
export const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];
const MAX_IMAGES = 16;
const MAX_IMAGE_BYTES = 20 * 1024 * 1024;

/** `file` as {media_type, data (base64), url (a data URL), name}. */
function readImage(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => {
      const url = String(reader.result);
      resolve({ media_type: file.type, data: url.slice(url.indexOf(",") + 1), url, name: file.name || "pasted image" });
    };
    reader.onerror = () => reject(new Error(`${file.name || "The image"} could not be read.`));
    reader.readAsDataURL(file);
  });
}

function MessageItem({ message, actions, running }) {
  const assistant = message.role === "assistant";
  const classes = [message.role, message.error ? "error" : null].filter(Boolean).join(" ");
  const images = message.images ?? [];
  return (
    <li class={classes}>
      {images.length > 0 && (
        <div class="images">
          {images.map((url, i) => (
            <img src={url} alt={`Attached image ${i + 1}`} />
          ))}
        </div>
      )}
      {/* Answers are Markdown (sanitized); what the user typed is shown as typed. */}
      {assistant ? <Markdown text={message.content} /> : <div class="body">{message.content}</div>}
      {assistant && <span class="meta">{message.error ?? (message.stats ? describeStats(message.stats, message.finish_reason) : "")}</span>}
      {assistant && message.sampling && <span class="sampling">{describeSampling(message.sampling)}</span>}
      {actions.map(([label, onClick]) => (
        <button type="button" class="action" disabled={running} onClick={onClick}>{label}</button>
      ))}
    </li>
  );
}

/**
 * The #view-chat section. `status`: the last model_status (for the model's sampling defaults);
 * `switcher`: the header's model switcher. `handle.current` has newConversation(), showError(error)
 * and focusInput() for app.jsx (the tray's New chat, the end of the first run).
 */
export function ChatView({ api, status, visible, inert, switcher, handle }) {
  const [list, setList] = useState([]);
  // What get_conversation returned (with the turn being generated added); also in a ref, read by
  // the turn's code as it goes on.
  const [conversation, setShown] = useState(null);
  const current = useRef(null);
  const setConversation = (next) => {
    current.current = next;
    setShown(next);
  };
  // {requestId} while an answer streams (requestId null until the command answered).
  const [running, setRunningShown] = useState(null);
  const runningNow = useRef(null);
  const setRunning = (next) => {
    runningNow.current = next;
    setRunningShown(next);
  };
  const [stream, setStream] = useState(null); // the answer being generated: {text, sampling}
  const [editing, setEditingShown] = useState(false);
  const editingNow = useRef(false);
  const [error, setError] = useState(null);
  const [notice, setNotice] = useState(null);
  const [sidebar, setSidebar] = useState(false);
  const [renaming, setRenaming] = useState(false);
  const renamingNow = useRef(false);
  // Images attached to the next message: [{media_type, data, url, name}].
  const [attached, setAttachedShown] = useState([]);
  const attachedNow = useRef([]);
  const setAttached = (next) => {
    attachedNow.current = next;
    setAttachedShown(next);
  };
  const fileInput = useRef(null);
  const [deleteArmed, confirmDelete] = useConfirm(3000);
  const input = useRef(null);
  const search = useRef(null);
  const rename = useRef(null);
  const messagesEnd = useRef(null);
  // Images are attached but the loaded model reads none: Send waits until they go or a model that
  // sees images is loaded.
  const takesNoImages = attached.length > 0 && !editing && status?.state === "loaded" && !status.vision;

  async function refreshList() {
    const found = await api.listConversations(search.current.value);
    setList(found);
    return found;
  }

  function setEditing(on, content = "") {
    editingNow.current = on;
    setEditingShown(on);
    if (on) {
      input.current.value = content;
      input.current.focus();
    }
  }

  async function select(id) {
    if (runningNow.current) return; // one answer at a time: switching would hide the stream
    setEditing(false);
    setError(null);
    setStream(null);
    setConversation(await api.getConversation(id));
    await refreshList();
  }

  async function newConversation() {
    if (runningNow.current) return;
    const summary = await api.createConversation();
    await select(summary.id);
    input.current.focus();
  }

  /** Lists the conversations and opens the most recent one. */
  async function init() {
    const found = await refreshList();
    if (found.length) await select(found[0].id);
  }

  /** Attaches the image files among `files` (the file picker's, a paste's, a drop's); others say why not. */
  async function attach(files) {
    const images = [...files].filter((file) => file.type.startsWith("image/"));
    if (files.length > 0 && images.length === 0) return;
    if (editingNow.current) {
      setError("Images go with a new message: an edit changes the last message's text only.");
      return;
    }
    const refused = images.find((file) => !IMAGE_TYPES.includes(file.type) || file.size > MAX_IMAGE_BYTES);
    if (refused) {
      setError(
        IMAGE_TYPES.includes(refused.type)
          ? `${refused.name} is larger than 20 MB.`
          : `${refused.name || "That image"} is not a PNG, JPEG, WebP or GIF image.`,
      );
      return;
    }
    if (attachedNow.current.length + images.length > MAX_IMAGES) {
      setError(`A message takes at most ${MAX_IMAGES} images.`);
      return;
    }
    try {
      const read = await Promise.all(images.map(readImage));
      // Checked again: another paste may have attached some meanwhile.
      if (attachedNow.current.length + read.length > MAX_IMAGES) {
        setError(`A message takes at most ${MAX_IMAGES} images.`);
        return;
      }
      setAttached([...attachedNow.current, ...read]);
      setError(null);
    } catch (failure) {
      setError(failure);
    }
  }

  function submit() {
    const text = input.current.value.trim();
    const images = editingNow.current ? [] : attachedNow.current;
    if ((!text && images.length === 0) || runningNow.current || takesNoImages) return;
    input.current.value = "";
    const turn = editingNow.current ? { kind: "edit_last", content: text } : { kind: "send", content: text };
    if (images.length > 0) turn.images = images.map(({ media_type, data }) => ({ media_type, data }));
    setAttached([]);
    setEditing(false);
    // A turn the command refused gives its images back to the composer.
    return startTurn(turn).then((started) => {
      if (!started && images.length > 0 && attachedNow.current.length === 0) setAttached(images);
    });
  }

  /**
   * Runs `turn`: the answer streams into a new message; when it is finished (and saved, see
   * commands/chat.rs) the conversation is read back from the history and drawn again.
   */
  async function startTurn(turn) {
    setError(null);
    setNotice(null);
    if (!current.current) {
      const summary = await api.createConversation();
      setConversation(await api.getConversation(summary.id));
    }
    const id = current.current.id;
    // Show the turn at once, as the history will have it.
    const messages = [...current.current.messages];
    const lastUser = messages.findLastIndex((m) => m.role === "user");
    if (turn.kind === "send") {
      const images = (turn.images ?? []).map(({ media_type, data }) => `data:${media_type};base64,${data}`);
      messages.push({ role: "user", content: turn.content, images });
    }
    else {
      messages.splice(lastUser + 1);
      if (turn.kind === "edit_last") messages[lastUser] = { ...messages[lastUser], content: turn.content };
    }
    setConversation({ ...current.current, messages });
    const run = { requestId: null };
    setRunning(run);
    setStream({ text: "", sampling: null });
    let answer = "";
    let drawPending = false;
    let onEvent;
    const finished = new Promise((resolve) => {
      onEvent = (event) => {
        if (event.event === "token") {
          answer += event.text;
          // Markdown is parsed at most once per frame, however fast tokens come.
          if (!drawPending) {
            drawPending = true;
            const draw = () => {
              drawPending = false;
              setStream((now) => now && { ...now, text: answer });
            };
            const frame = globalThis.requestAnimationFrame;
            frame ? frame(draw) : draw();
          }
        } else if (event.event === "started") {
          setStream((now) => now && { ...now, sampling: event.sampling });
        } else if (event.event === "context_trimmed") {
          const n = event.dropped_messages;
          setNotice(
            `This conversation is longer than the model's context: its first ${n} message${n === 1 ? "" : "s"} ` +
              "(after the system prompt) were left out of this answer. They stay in the history.",
          );
        } else if (event.event === "finished") {
          resolve(event);
        }
      };
    });
    try {
      const requestId = await api.chat(id, turn, (event) => onEvent(event));
      setRunning({ requestId });
      // The turn is in the history now: a first message also names the conversation.
      const found = await refreshList();
      const title = found.find((c) => c.id === id)?.title;
      if (title && current.current?.id === id) setConversation({ ...current.current, title });
    } catch (failure) {
      setRunning(null);
      setStream(null);
      setError(failure);
      setConversation(await api.getConversation(id).catch(() => null));
      return false;
    }
    const event = await finished;
    setRunning(null);
    if (event.save_error) setError(event.save_error);
    try {
      setConversation(await api.getConversation(id));
    } catch (failure) {
      setError(failure);
    } finally {
      // The saved answer replaces the streamed one; if it cannot be read, the stream goes too.
      setStream(null);
    }
    await refreshList();
    return true;
  }

  /** Stops the answer being generated (the engine cancels it at once; the part shown is kept). */
  function stop() {
    const requestId = runningNow.current?.requestId;
    if (requestId != null) return api.stop(requestId);
  }

  function startRename() {
    if (!current.current) return;
    renamingNow.current = true;
    setRenaming(true);
  }

  async function finishRename(save) {
    if (!renamingNow.current) return; // once: Enter, Escape or leaving the field
    renamingNow.current = false;
    const title = rename.current.value;
    setRenaming(false);
    if (!save) return;
    try {
      const summary = await api.renameConversation(current.current.id, title);
      setConversation({ ...current.current, title: summary.title });
      await refreshList();
    } catch (failure) {
      setError(failure);
    }
  }

  useLayoutEffect(() => {
    if (!renaming) return;
    rename.current.value = current.current.title;
    rename.current.focus();
  }, [renaming]);

  /** Deletes after a second click on the same button within 3 s. */
  async function remove() {
    if (!current.current || runningNow.current) return;
    if (!confirmDelete()) return;
    await api.deleteConversation(current.current.id);
    // The next conversation replaces the deleted one (the button, focused, stays enabled).
    const found = await refreshList();
    if (found.length) await select(found[0].id);
    else setConversation(null);
  }

  useImperativeHandle(handle, () => ({
    newConversation,
    showError: setError,
    focusInput: () => input.current.focus(),
  }));

  useEffect(() => {
    init().catch(setError);
  }, []);

  // The newest message (or the answer as it grows) is scrolled into view.
  const messages = conversation?.messages ?? [];
  useLayoutEffect(() => {
    messagesEnd.current?.lastElementChild?.scrollIntoView?.({ block: "end" });
  }, [conversation?.id, messages.length, stream?.text, stream !== null]);

  const lastUser = messages.findLastIndex((m) => m.role === "user");
  const actions = (message, index) => {
    if (message.role === "assistant") {
      return [
        ...(index === messages.length - 1 ? [["Regenerate", () => startTurn({ kind: "regenerate" })]] : []),
        ["Copy", () => copyText(message.content)],
      ];
    }
    return index === lastUser ? [["Edit", () => setEditing(true, message.content)]] : [];
  };
  return (
    <section id="view-chat" class="view" hidden={!visible} inert={inert}>
      <aside id="conversations" class={sidebar ? "open" : undefined}>
        <div class="row">
          <input id="search" type="search" ref={search} placeholder="Search chats" aria-label="Search chats" onInput={() => refreshList()} />
          <button type="button" id="new-chat" data-icon="new-chat" onClick={() => newConversation()}>
            <Icon name="new-chat" />New chat
          </button>
        </div>
        <ul id="conversation-list">
          {list.map((summary) => (
            <li key={summary.id} class={summary.id === conversation?.id ? "current" : undefined}>
              <button
                type="button"
                data-id={summary.id}
                onClick={() => {
                  setSidebar(false);
                  select(summary.id);
                }}
              >
                {summary.title}
              </button>
            </li>
          ))}
        </ul>
      </aside>
      <div class="chat-main">
        <header class="row chat-header">
          <button type="button" id="toggle-conversations" title="Chats" aria-label="Show chats" aria-controls="conversations" aria-expanded={String(sidebar)} data-icon="menu" onClick={() => setSidebar(!sidebar)}>
            <Icon name="menu" />
          </button>
          {renaming ? (
            <input
              class="rename"
              aria-label="Chat title"
              ref={rename}
              onKeyDown={(event) => {
                if (event.key === "Enter") finishRename(true);
                if (event.key === "Escape") finishRename(false);
              }}
              onBlur={() => finishRename(true)}
            />
          ) : (
            <h2 id="chat-title">{conversation?.title ?? "New chat"}</h2>
          )}
          {switcher}
          <button type="button" id="rename" disabled={!conversation} onClick={startRename}>Rename</button>
          <button type="button" id="delete" class={deleteArmed ? "confirm" : undefined} disabled={!conversation} onClick={remove}>
            {deleteArmed ? "Delete?" : "Delete"}
          </button>
        </header>
        <ConversationSettings api={api} conversation={conversation} status={status} onSaved={(settings) => setConversation({ ...current.current, settings })} />
        <div id="chat-empty" class="empty-state" hidden={messages.length > 0 || stream !== null}>
          <h3>Start a conversation</h3>
          <p>Type a message below. The model runs on this machine: what you write stays here.</p>
        </div>
        <ol id="messages" ref={messagesEnd}>
          {messages.map((message, index) => (
            <Message key={index} message={message} actions={actions(message, index)} running={running !== null} />
          ))}
          {stream && (
            <li class="assistant streaming">
              <Markdown text={stream.text} />
              {stream.sampling && <span class="sampling">{describeSampling(stream.sampling)}</span>}
            </li>
          )}
        </ol>
        <p id="chat-notice" class="notice" hidden={!notice}>{notice ?? ""}</p>
        <div id="chat-error" role="alert" hidden={!error}>
          {error && <ErrorMessage error={error} as="span" />}
        </div>
        <form
          id="composer"
          onSubmit={(event) => {
            event.preventDefault();
            submit();
          }}
          onDragOver={(event) => {
            if ([...(event.dataTransfer?.types ?? [])].includes("Files")) event.preventDefault();
          }}
          onDrop={(event) => {
            if (!event.dataTransfer?.files?.length) return;
            event.preventDefault();
            attach(event.dataTransfer.files);
          }}
        >
          <p id="editing" hidden={!editing}>
            Editing your last message. <button type="button" id="cancel-edit" onClick={() => setEditing(false)}>Cancel</button>
          </p>
          {attached.length > 0 && (
            <ul id="attachments" aria-label="Attached images">
              {attached.map((image, i) => (
                <li>
                  <img src={image.url} alt={image.name} />
                  <button type="button" aria-label={`Remove ${image.name}`} onClick={() => setAttached(attachedNow.current.filter((_, j) => j !== i))}>
                    ×
                  </button>
                </li>
              ))}
            </ul>
          )}
          <p id="attach-note" class="notice" hidden={!takesNoImages}>
            {status?.name ?? "This model"} takes no images: load a model marked “sees images”, or remove them.
          </p>
          <textarea
            id="input"
            rows="3"
            ref={input}
            aria-label="Message"
            placeholder="Message the model (Enter sends, Shift+Enter breaks the line)"
            onPaste={(event) => {
              const files = event.clipboardData?.files;
              if (files && [...files].some((file) => file.type.startsWith("image/"))) {
                event.preventDefault();
                attach(files);
              }
            }}
            onKeyDown={(event) => {
              if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
                event.preventDefault();
                submit();
              } else if (event.key === "Escape" && runningNow.current && !event.isComposing) {
                // Escape stops the answer being generated, as Stop does.
                event.preventDefault();
                stop();
              }
            }}
          />
          <div class="row">
            <button type="submit" id="send" data-icon="send" disabled={running !== null || takesNoImages}>
              <Icon name="send" />Send
            </button>
            <button type="button" id="attach" data-icon="attach" disabled={editing} onClick={() => fileInput.current.click()}>
              <Icon name="attach" />Attach image
            </button>
            <input
              type="file"
              id="attach-file"
              ref={fileInput}
              hidden
              multiple
              accept={IMAGE_TYPES.join(",")}
              onChange={(event) => {
                attach(event.currentTarget.files);
                event.currentTarget.value = "";
              }}
            />
            <button type="button" id="stop" data-icon="stop" disabled={running?.requestId == null} onClick={stop}>
              <Icon name="stop" />Stop
            </button>
          </div>
        </form>
      </div>
    </section>
  );
}
