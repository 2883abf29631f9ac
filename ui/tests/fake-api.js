// A fake of every command of src/api.js, for tests that draw the whole app (src/app.jsx): a
// quiet machine with no model loaded, no conversation, the first run done. Tests override what
// they need; `emit.navigate(view)` and the others play the tray's events.
import { vi } from "vitest";

export function fakeApi(overrides = {}) {
  const emit = {};
  const listen = (name) => vi.fn(async (handler) => {
    emit[name] = handler;
    return () => delete emit[name];
  });
  const settings = {
    first_run_done: true,
    chat: { system_prompt: "", sampling_source: "model", max_tokens: 1024,
      sampling: { temperature: 0.7, top_p: 0.9, top_k: 40, min_p: 0.05, repetition_penalty: 1, logit_bias: {}, seed: null } },
    kv_cache_bytes: 2 ** 31, block_size: 32, models_dir: null, launch_at_login: false, shortcut: "",
    server: { enabled: false, port: 8080, api_key: null, allow_lan: false, any_model_name: false, model_aliases: [] },
    hosts: [],
  };
  return {
    emit,
    modelStatus: vi.fn(async () => ({ state: "not_loaded" })),
    listModels: vi.fn(async () => []),
    deleteModel: vi.fn(async () => 0),
    loadModel: vi.fn(async () => {}),
    unloadModel: vi.fn(async () => {}),
    engineStats: vi.fn(async () => Promise.reject("no model is loaded")),
    clearCache: vi.fn(async () => {}),
    resetPeakMemory: vi.fn(async () => {}),
    searchModels: vi.fn(async () => []),
    downloadModel: vi.fn(() => new Promise(() => {})),
    cancelDownload: vi.fn(async () => {}),
    partialDownloads: vi.fn(async () => []),
    discardPartialDownload: vi.fn(async () => 0),
    serverStatus: vi.fn(async () => ({ running: false, url: null, requests: 0, served: 0, api_key: false, allow_lan: false })),
    checkHosts: vi.fn(async () => ({ hosts: [], machines: [], memory_bytes: null })),
    hostsStatus: vi.fn(async () => null),
    systemStats: vi.fn(async () => ({ ram_used_bytes: 4e9, ram_total_bytes: 16e9, usable_memory_bytes: 12e9, process_rss_bytes: 1e8 })),
    listConversations: vi.fn(async () => []),
    createConversation: vi.fn(async () => ({ id: 1, title: "New chat" })),
    getConversation: vi.fn(async (id) => ({ id, title: "New chat", settings: settings.chat, messages: [] })),
    renameConversation: vi.fn(async (id, title) => ({ id, title })),
    deleteConversation: vi.fn(async () => {}),
    setConversationSettings: vi.fn(async () => {}),
    chat: vi.fn(async () => 1),
    stop: vi.fn(async () => {}),
    getSettings: vi.fn(async () => ({ settings, defaults: settings, models_dir: "/m", total_memory_bytes: 16e9 })),
    saveSettings: vi.fn(async (s) => ({ settings: s, defaults: settings, models_dir: "/m", total_memory_bytes: 16e9 })),
    startupNotices: vi.fn(async () => []),
    finishFirstRun: vi.fn(async () => {}),
    onNavigate: listen("navigate"),
    onNewChat: listen("newChat"),
    onSettingsChanged: listen("settingsChanged"),
    onNotice: listen("notice"),
    ...overrides,
  };
}
