// Perch's window: the views (chat, dashboard, models, settings) under their navigation, the
// status line of the model, notices, and the first-run screen; wired to the Rust commands (`api`,
// src/api.js). Nothing here waits on the engine: every command is asynchronous.

import { useEffect, useLayoutEffect, useMemo, useRef, useState } from "preact/hooks";
import { ChatView } from "./chat.jsx";
import { Dashboard } from "./dashboard.jsx";
import { Boundary, ErrorMessage } from "./error-message.jsx";
import { describeModelStatus } from "./format.js";
import { Icon } from "./icons.jsx";
import { ModelSwitcher } from "./model-switcher.jsx";
import { ModelsView } from "./models.jsx";
import { firstRunPending, Onboarding } from "./onboarding.jsx";
import { SettingsView } from "./settings.jsx";
import { StatsSampler } from "./stats.js";

const VIEWS = [
  ["chat", "Chat"],
  ["dashboard", "Dashboard"],
  ["models", "Models"],
  ["settings", "Settings"],
];

let notices = 0;

/** What a notice says, to tell repeats apart. */
const noticeText = (said) => ("error" in said ? String(said.error?.message ?? said.error) : said.text);

/**
 * `api`: src/api.js (tests pass a fake); `storage`: the web view's storage (where earlier
 * versions remembered the first run); `sampler`: the dashboard's StatsSampler (made here when
 * not given).
 */
export function App({ api, storage, sampler: given }) {
  const sampler = useMemo(() => given ?? new StatsSampler(api), []);
  const [view, setView] = useState("chat");
  const [status, setStatus] = useState(null); // the last model_status
  const [loadingFor, setLoadingFor] = useState(0); // seconds the model has been loading
  const loadingSince = useRef(null);
  const [shown, setNotices] = useState([]); // [{id, text}] or [{id, error}]
  const [firstRun, setFirstRun] = useState(false);
  const [firstRunError, setFirstRunError] = useState(null); // {error} when it could not be read
  const chat = useRef(null);
  const settings = useRef(null);
  const models = useRef(null);
  const switcher = useRef(null);
  const focusChat = useRef(false);

  /** Says `notice` ({text} or {error}) above the views until dismissed. */
  // A notice already shown is not added again (a failure that repeats says so once).
  const notice = (said) =>
    setNotices((now) => (now.some((n) => noticeText(n) === noticeText(said)) ? now : [...now, { id: ++notices, ...said }]));

  function show(next) {
    setView(next);
    if (next === "models") models.current.show();
    if (next === "chat") switcher.current?.refresh().catch(() => {});
    if (next === "settings") settings.current.load();
  }

  async function refreshStatus() {
    const next = await api.modelStatus();
    if (next.state === "loading") loadingSince.current ??= Date.now();
    else loadingSince.current = null;
    setLoadingFor(loadingSince.current ? (Date.now() - loadingSince.current) / 1000 : 0);
    setStatus(next);
  }

  /** Loads the model in `path`, showing its progress in the status line. */
  async function loadModel(path) {
    const poll = setInterval(refreshStatus, 250);
    try {
      await api.loadModel(path);
    } catch {
      // The status line shows the error (model_status is `failed`).
    } finally {
      clearInterval(poll);
      refreshStatus();
      switcher.current?.refresh().catch(() => {});
    }
  }

  // A failure no view handled is still said, not lost in a console nobody sees.
  useLayoutEffect(() => {
    const rejected = (event) => notice({ error: event.reason });
    const failed = (event) => notice({ error: event.error ?? event.message });
    window.addEventListener("unhandledrejection", rejected);
    window.addEventListener("error", failed);
    return () => {
      window.removeEventListener("unhandledrejection", rejected);
      window.removeEventListener("error", failed);
    };
  }, []);

  useEffect(() => {
    const listening = [
      api.onNavigate(show),
      api.onNewChat(() => chat.current.newConversation().catch((error) => chat.current.showError(error))),
      api.onNotice((error) => notice({ error })),
      // The tray switched the local server: the form shows it, so a later Save keeps it.
      api.onSettingsChanged(() => settings.current.load()),
    ];
    api.startupNotices().then((texts) => texts.forEach((text) => notice({ text })));
    firstRunPending(api, storage)
      .then((pending) => pending && setFirstRun(true))
      .catch((error) => setFirstRunError({ error }));
    sampler.start();
    refreshStatus();
    const timer = setInterval(refreshStatus, 1000);
    return () => {
      clearInterval(timer);
      sampler.stop();
      for (const unlisten of listening) Promise.resolve(unlisten).then((stop) => stop?.());
    };
  }, []);

  // The first run closed: the composer gets the focus once the page behind it is usable again.
  useLayoutEffect(() => {
    if (firstRun || !focusChat.current) return;
    focusChat.current = false;
    chat.current.focusInput();
  }, [firstRun]);

  // While the first-run screen is open the rest of the page cannot be reached (tab, screen readers).
  const inert = firstRun || undefined;
  const loading = status?.state === "loading";
  const bar = loading && status.bytes_total > 0;
  return (
    <>
      <Onboarding
        api={api}
        open={firstRun}
        error={firstRunError}
        onLoad={loadModel}
        onDone={() => {
          focusChat.current = true;
          setFirstRun(false);
          show("chat");
        }}
      />
      <nav aria-label="Views" inert={inert}>
        {VIEWS.map(([id, label]) => (
          <button
            type="button"
            data-view={id}
            data-icon={id}
            class={view === id ? "active" : undefined}
            aria-current={view === id ? "page" : undefined}
            onClick={() => show(id)}
          >
            <Icon name={id} />
            {label}
          </button>
        ))}
      </nav>
      <div id="notices" inert={inert}>
        {shown.map((said) => (
          <div key={said.id} class="notice">
            {"error" in said ? <ErrorMessage error={said.error} as="span" /> : said.text}{" "}
            <button type="button" onClick={() => setNotices((now) => now.filter((n) => n.id !== said.id))}>Dismiss</button>
          </div>
        ))}
      </div>
      <p id="model-status" class={loading ? "status loading" : "status"} inert={inert}>
        {status ? describeModelStatus(status, loadingFor) : "No model loaded."}
      </p>
      <progress id="model-progress" max={1} value={bar ? status.bytes_read / status.bytes_total : 0} aria-label="Loading the model" hidden={!bar} inert={inert} />
      <Boundary>
        <ChatView
          api={api}
          status={status}
          visible={view === "chat"}
          inert={inert}
          handle={chat}
          switcher={<ModelSwitcher api={api} status={status} onLoad={loadModel} handle={switcher} />}
        />
      </Boundary>
      <Boundary>
        <Dashboard api={api} sampler={sampler} visible={view === "dashboard"} inert={inert} />
      </Boundary>
      <Boundary>
        <ModelsView api={api} visible={view === "models"} inert={inert} onLoad={loadModel} onUnload={() => api.unloadModel().then(refreshStatus)} handle={models} />
      </Boundary>
      <Boundary>
        <SettingsView api={api} visible={view === "settings"} inert={inert} handle={settings} />
      </Boundary>
    </>
  );
}
