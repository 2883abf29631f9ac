// The Rust commands of src-tauri/src/commands/, one function each. Views take this object as a
// parameter, so tests can hand them a fake.

import { invoke as tauriInvoke, Channel } from "@tauri-apps/api/core";
import { listen } from "@tauri-apps/api/event";

/**
 * A command's failure: the Rust side rejects with {kind, message} (CommandError in
 * src-tauri/src/commands/mod.rs): `kind` says what failed ("invalid_input", "model_not_loaded", "invalid_model",
 * "context_length_exceeded", "overloaded", "out_of_memory", "network", "storage", "internal"), `message` is one
 * sentence for the user. String(error) is the sentence.
 */
export class CommandError extends Error {
  constructor({ kind, message }) {
    super(message);
    this.name = "CommandError";
    this.kind = kind;
  }

  toString() {
    return this.message;
  }
}

/** `invoke`, its rejections as CommandErrors when the command sent one. */
export async function invoke(command, args) {
  try {
    return await tauriInvoke(command, args);
  } catch (error) {
    if (error && typeof error === "object" && typeof error.message === "string" && "kind" in error) {
      throw new CommandError(error);
    }
    throw error;
  }
}

export const api = {
  // Models (commands/model.rs)
  modelStatus: () => invoke("model_status"),
  listModels: () => invoke("list_models"),
  /** Deletes a model on this machine (not the loaded one); resolves to the bytes freed. */
  deleteModel: (path) => invoke("delete_model", { path }),
  loadModel: (path) => invoke("load_model", { path }),
  unloadModel: () => invoke("unload_model"),
  engineStats: () => invoke("engine_stats"),
  clearCache: () => invoke("clear_cache"),
  resetPeakMemory: () => invoke("reset_peak_memory"),
  // The Hugging Face Hub (commands/hub.rs)
  searchModels: (text, author) => invoke("search_models", { text, author }),
  /** Resolves to {snapshot_dir, bytes_fetched, bytes_reused}; `onProgress` gets DownloadProgress;
   * `revision`: a branch, tag or commit (`main` when none). */
  downloadModel: (repoId, onProgress, revision) => {
    const channel = new Channel();
    channel.onmessage = onProgress;
    return invoke("download_model", { repoId, revision: revision || null, onProgress: channel });
  },
  cancelDownload: (repoId) => invoke("cancel_download", { repoId }),
  /** Downloads that stopped before their end: [{repo_id, bytes_present, has_snapshot}]. */
  partialDownloads: () => invoke("partial_downloads"),
  /** Deletes a stopped download's partial files; resolves to the bytes freed. */
  discardPartialDownload: (repoId) => invoke("discard_partial_download", { repoId }),
  // The local API server (commands/server.rs): {running, url, requests, served, api_key, allow_lan}
  serverStatus: () => invoke("server_status"),
  /** Reads the memory of the saved hosts' machines over ssh (HostsView of src-tauri's hosts.rs). */
  checkHosts: () => invoke("check_hosts"),
  /** The last reading of the saved hosts, or null. */
  hostsStatus: () => invoke("hosts_status"),
  // System (commands/system.rs)
  systemStats: () => invoke("system_stats"),
  // Conversations and chat (commands/chat.rs)
  listConversations: (search) => invoke("list_conversations", { search }),
  createConversation: () => invoke("create_conversation"),
  getConversation: (id) => invoke("get_conversation", { id }),
  renameConversation: (id, title) => invoke("rename_conversation", { id, title }),
  deleteConversation: (id) => invoke("delete_conversation", { id }),
  setConversationSettings: (id, settings) => invoke("set_conversation_settings", { id, settings }),
  /**
   * Starts a turn of conversation `conversationId`: `turn` is {kind: "send", content},
   * {kind: "regenerate"} or {kind: "edit_last", content}. `onEvent` receives the ChatEvents
   * ({event: "token", text} ... {event: "finished", ...}). Resolves to the request id.
   */
  chat: (conversationId, turn, onEvent) => {
    const channel = new Channel();
    channel.onmessage = onEvent;
    return invoke("chat", { conversationId, turn, onEvent: channel });
  },
  stop: (requestId) => invoke("stop", { requestId }),
  // Settings (commands/settings.rs)
  getSettings: () => invoke("get_settings"),
  saveSettings: (settings) => invoke("save_settings", { settings }),
  startupNotices: () => invoke("startup_notices"),
  finishFirstRun: () => invoke("finish_first_run"),
  // The tray menu's "open this view".
  onNavigate: (handler) => listen("navigate", (event) => handler(event.payload)),
  // The tray menu's "New chat".
  onNewChat: (handler) => listen("new-chat", () => handler()),
  // The settings changed outside the Settings form (the tray's local server switch).
  onSettingsChanged: (handler) => listen("settings-changed", () => handler()),
  // A failure of a tray action (switching the model, the local server), as a CommandError.
  onNotice: (handler) => listen("notice", (event) => handler(new CommandError(event.payload))),
};
