// The Rust commands of src-tauri/src/commands/, one function each. Views take this object as a
// parameter, so tests can hand them a fake.

import { invoke, Channel } from "@tauri-apps/api/core";
import { listen } from "@tauri-apps/api/event";

export const api = {
  // Models (commands/model.rs)
  modelStatus: () => invoke("model_status"),
  listModels: () => invoke("list_models"),
  loadModel: (path) => invoke("load_model", { path }),
  unloadModel: () => invoke("unload_model"),
  engineStats: () => invoke("engine_stats"),
  clearCache: () => invoke("clear_cache"),
  resetPeakMemory: () => invoke("reset_peak_memory"),
  // The Hugging Face Hub (commands/hub.rs)
  searchModels: (text, author) => invoke("search_models", { text, author }),
  /** Resolves to {snapshot_dir, bytes_fetched, bytes_reused}; `onProgress` gets DownloadProgress. */
  downloadModel: (repoId, onProgress) => {
    const channel = new Channel();
    channel.onmessage = onProgress;
    return invoke("download_model", { repoId, onProgress: channel });
  },
  cancelDownload: (repoId) => invoke("cancel_download", { repoId }),
  // The local API server (commands/server.rs): {running, url, requests, served, api_key, allow_lan}
  serverStatus: () => invoke("server_status"),
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
  // The tray menu's "open this view".
  onNavigate: (handler) => listen("navigate", (event) => handler(event.payload)),
};
