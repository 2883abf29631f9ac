"""End-to-end test of the app in its real web view (WebKitGTK), driven through tauri-driver and
WebKitWebDriver under Xvfb, with the imported default model loaded:

1. the first-run screen says what Perch is and this machine's memory, offers models, and is skipped;
   the model loads at start; on this fresh install the first answer is sampled with the model's
   defaults (the test model names none in its generation_config.json: Perch's, said under the
   answer, kept with it, and in the conversation's settings); in a second conversation set to
   greedy in its settings, a message is sent and its answer streams into the page token by
   token; the dashboard's graphs redraw while it generates; Stop ends it mid-answer;
2. the model picker finds the test model on the fake hub (scripts/e2e.sh starts it), shows its
   download's progress, lists it under "On this machine" once downloaded, and loads it by its id;
   at the end of the first run the chat's model switcher loads the model in Perch's models
   directory again, and the local server follows;
3. the global shortcut (Ctrl+Shift+Space, sent by xdotool) brings the chat back from another view,
   and "Launch at login" in Settings writes and removes the XDG autostart entry;
4. Settings → Local server turns the API server on (a free port, a key) before the first message:
   while that answer streams in the window, a request over HTTP gets its own answer from the same
   engine; after the model picker, the server lists the newly loaded model, refuses a request
   without the key and answers with it, and the dashboard shows the address and both requests;
5. the app is restarted on the same data directory and the conversation is there, with the
   stopped answer exactly as it was shown, and the local server is back on with the model the
   app loaded at start.

Screenshots of every screen (first run, chat, dashboard, models, settings) go to $PERCH_E2E_OUT
(default target/e2e; scripts/screenshots.sh copies a light and a dark tour into docs/screenshots).

Run by scripts/e2e.sh (which starts Xvfb and tauri-driver); needs the debug app binary.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from webdriver import Session  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = Path(os.environ.get("PERCH_APP", ROOT / "target/debug/perch-app"))
DRIVER = os.environ.get("TAURI_DRIVER_URL", "http://127.0.0.1:4444")
OUT = Path(os.environ.get("PERCH_E2E_OUT", ROOT / "target/e2e"))

QUESTION = "Count from 1 to 200, one number per line."


def text(session, css):
    return session.execute("const e = document.querySelector(arguments[0]); return e ? e.textContent : null", css)


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def fresh_install_sampling(session):
    """The first answer of a fresh install samples with the model's defaults, and says so."""
    session.type("#input", "Write a short poem about the sea.")
    session.click("#send")
    line = session.wait_for(
        "const s = document.querySelector('#messages > li.assistant .sampling');"
        " return s && s.textContent",
        what="the sampling of the answer",
    )
    expected = "temperature 0.8, top-p 0.95, top-k 40, min-p 0.05, repetition penalty 1.1 (Perch's defaults)"
    check(line == expected, f"a fresh install's answer was sampled with {line!r}, not {expected!r}")
    # Stopped (or ended by itself): the saved answer keeps the line.
    session.execute("document.getElementById('stop').click()")
    session.wait_for(
        "return document.querySelector('#messages > li.streaming') === null"
        " && document.querySelector('#messages > li.assistant .meta') !== null",
        what="the first answer's end",
    )
    check(text(session, "#messages > li.assistant .sampling") == line, "the saved answer lost its sampling")
    settings = session.execute(
        "const f = document.getElementById('conversation-settings');"
        " return [f.querySelector('[name=sampling_source]').value,"
        " f.querySelector('[name=temperature]').disabled, f.querySelector('[name=temperature]').value,"
        " document.getElementById('conversation-sampling-note').textContent]"
    )
    check(
        settings[:3] == ["model", True, "0.8"] and "Perch's defaults" in settings[3],
        f"the conversation's settings do not show the model's defaults: {settings!r}",
    )


def greedy_conversation(session):
    """A new conversation whose settings say: custom sampling, greedy, no repetition penalty."""
    # The conversations list may be folded away in a narrow window: its button is clicked in the page.
    session.execute("document.getElementById('new-chat').click()")
    session.wait_for("return document.querySelectorAll('#messages > li').length === 0", what="a new chat")
    session.execute(
        "const f = document.getElementById('conversation-settings'); f.open = true;"
        " const source = f.querySelector('[name=sampling_source]'); source.value = 'custom';"
        " source.dispatchEvent(new Event('change'));"
        " f.querySelector('[name=temperature]').value = '0';"
        " f.querySelector('[name=repetition_penalty]').value = '0';"
        " document.getElementById('save-conversation-settings').click(); f.open = false;"
    )
    session.wait_for(
        "return document.getElementById('conversation-settings-error').textContent === 'Saved.'",
        what="the conversation's settings saved",
    )


def onboarding(session):
    """The first-run screen: what Perch is, this machine's memory, models to start with; Skip."""
    session.wait_for("return !document.getElementById('onboarding').hidden", what="the first-run screen")
    machine = session.wait_for("return document.getElementById('onboarding-machine').textContent || null",
                               what="the machine's memory")
    check("of memory" in machine, machine)
    check(text(session, "#onboarding-title") == "Welcome to Perch", text(session, "#onboarding-title"))
    session.wait_for("return document.querySelectorAll('#onboarding-models > li').length > 0"
                     " || document.getElementById('onboarding-message').textContent !== ''",
                     what="models to start with")
    session.screenshot(OUT / "first-run.png")
    session.click("#onboarding-skip")
    session.wait_for("return document.getElementById('onboarding').hidden", what="the first-run screen to close")


def first_run(session, port):
    onboarding(session)
    model = loaded_model(session)
    enable_server(session, port)
    session.click("nav button[data-view=chat]")
    fresh_install_sampling(session)
    greedy_conversation(session)
    session.type("#input", QUESTION)
    session.click("#send")

    # Tokens arrive in the DOM one after another while the answer is generated.
    streaming = "#messages > li.assistant.streaming .body"
    seen = []
    deadline = time.monotonic() + 120
    while len(set(seen)) < 4 and time.monotonic() < deadline:
        current = text(session, streaming)
        if current:
            seen.append(current)
        time.sleep(0.05)
    check(len(set(seen)) >= 4, f"the answer did not stream: {seen!r}")
    session.screenshot(OUT / "chat-streaming.png")

    # While the chat streams, a client of the local server gets its answer from the same engine.
    status, answer = api(port, "/chat/completions", {
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]})
    check(status == 200 and answer["choices"][0]["message"]["content"], f"chat completion: {status} {answer}")
    check(text(session, streaming) is not None, "the chat stopped streaming while the server answered")

    # The dashboard's graphs redraw while the answer is generated.
    session.click("nav button[data-view=dashboard]")
    session.wait_for("return document.querySelectorAll('#charts canvas').length >= 5", what="the graphs")
    snapshot = "return [...document.querySelectorAll('#charts canvas')].map(c => c.toDataURL()).join()"
    before = session.execute(snapshot)
    time.sleep(2.5)
    check(session.execute(snapshot) != before, "the dashboard's graphs did not move while generating")
    check(
        session.execute("return document.querySelector('.chart') !== null")
        and "Decode" in (text(session, "#charts") or ""),
        "the throughput graph is missing",
    )
    session.screenshot(OUT / "dashboard.png")

    # Stop mid-answer: the answer ends at once as stopped, far short of 200 numbers.
    session.click("nav button[data-view=chat]")
    session.click("#stop")
    session.wait_for(
        "return document.querySelector('#messages > li.streaming') === null"
        " && document.querySelector('#messages > li.assistant .meta') !== null",
        what="the stopped answer",
    )
    meta = text(session, "#messages > li.assistant .meta")
    check(meta.endswith("stopped"), f"the answer was not stopped: {meta!r}")
    tokens = int(meta.split(" tokens")[0])
    check(0 < tokens < 1024, f"the answer was not cut short: {meta!r}")
    shown = text(session, "#messages > li.assistant .body")
    session.screenshot(OUT / "chat-stopped.png")
    return shown


def model_picker(session):
    repo = os.environ["PERCH_E2E_HUB_REPO"]
    session.click("nav button[data-view=models]")
    session.wait_for("return document.querySelectorAll('#hub-results > li').length > 0",
                     what="the Hub's models")
    session.type("#hub-search", "smollm")
    session.click("#hub-form button[type=submit]")
    result = f"#hub-results > li[data-repo='{repo}']"
    session.wait_for(f"return document.querySelector(\"{result}\") !== null", what="the search result")
    check("fits in memory" in text(session, result), text(session, result))
    session.execute(
        "[...document.querySelector(arguments[0]).querySelectorAll('button')]"
        ".find(b => b.textContent === 'Download').click()", result)
    # Progress is shown while it downloads, then the model is on this machine.
    session.wait_for(f"const p = document.querySelector(\"{result} progress\"); return p && p.value > 0",
                     what="the download's progress")
    session.screenshot(OUT / "models-downloading.png")
    session.wait_for(f"return [...document.querySelectorAll(\"{result} button\")]"
                     ".some(b => b.textContent === 'Load')", what="the download to finish")
    local = session.wait_for(
        "const li = [...document.querySelectorAll('#models > li')]"
        f".find(li => li.textContent.startsWith({json.dumps(repo)})); return li ? li.textContent : null",
        what="the downloaded model in the local list")
    check("Hugging Face cache" in local, local)
    session.execute(
        "[...document.querySelector(arguments[0]).querySelectorAll('button')]"
        ".find(b => b.textContent === 'Load').click()", result)
    session.wait_for(f"return document.getElementById('model-status').textContent === 'Model: {repo}'",
                     what="the downloaded model to load")
    ref = Path(os.environ["HF_HUB_CACHE"]) / f"models--{repo.replace('/', '--')}" / "refs/main"
    check(ref.is_file(), f"{ref} is missing")
    session.screenshot(OUT / "models.png")
    session.click("nav button[data-view=chat]")


def desktop_hooks(session):
    # The global shortcut summons the chat from any view.
    session.click("nav button[data-view=dashboard]")
    session.wait_for("return document.getElementById('view-chat').hidden", what="the dashboard")
    subprocess.run(["xdotool", "key", "--clearmodifiers", "ctrl+shift+space"], check=True)
    session.wait_for("return !document.getElementById('view-chat').hidden", timeout=10,
                     what="the global shortcut to show the chat")

    # Launch at login: the autostart entry appears when saved on and goes when saved off.
    entry = Path(os.environ["HOME"]) / ".config/autostart/Perch.desktop"
    check(not entry.exists(), f"{entry} exists before the setting is on")
    session.click("nav button[data-view=settings]")
    session.wait_for("return document.getElementById('view-settings').dataset.ready === 'true'",
                     what="the settings")
    session.screenshot(OUT / "settings.png")
    for on in (True, False):
        session.click("[data-setting=launch_at_login]")
        session.click("#settings-form button[type=submit]")
        save_settings_answer(session, "the settings")
        check(entry.exists() == on, f"launch at login {on}: {entry} exists is {entry.exists()}")
        if on:
            check("perch-app" in entry.read_text(), entry.read_text())
    session.click("nav button[data-view=chat]")


API_KEY = "e2e-key"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(port, path, body=None, key=API_KEY):
    """One request to the app's local server, as curl would send it (no proxy): (status, JSON)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1{path}", data=data, headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def loaded_model(session):
    return session.wait_for(
        "const t = document.getElementById('model-status').textContent;"
        " return t.startsWith('Model: ') ? t.slice(7) : null", what="a loaded model")


def served_model_id(port):
    status, models = api(port, "/models")
    check(status == 200, f"GET /v1/models: {status} {models}")
    return [m["id"] for m in models["data"]]


def save_settings_answer(session, what):
    # The Settings form's answer to a save: "Saved…", or the error it shows instead (reported as is).
    message = session.wait_for("return document.getElementById('settings-message').textContent",
                               timeout=30, what=f"an answer to saving {what}")
    check(message.startswith("Saved"), f"saving {what}: {message}")
    session.execute("document.getElementById('settings-message').textContent = ''")


def enable_server(session, port):
    session.click("nav button[data-view=settings]")
    session.wait_for("return document.getElementById('view-settings').dataset.ready === 'true'",
                     what="the settings")
    # The local server's settings are under Advanced.
    session.execute("document.getElementById('settings-advanced').open = true")
    check(not session.execute("return document.querySelector(\"[data-setting='server.enabled']\").checked"),
          "the local server is on before it was turned on")
    session.click("[data-setting='server.enabled']")
    session.execute("document.querySelector(\"[data-setting='server.port']\").value = arguments[0]", str(port))
    session.type("[data-setting='server.api_key']", API_KEY)
    session.click("#settings-form button[type=submit]")
    save_settings_answer(session, "the server settings")


def local_server(session, port):
    # After the model picker loaded another model: the server serves that one now.
    model = loaded_model(session)
    check(served_model_id(port) == [model], f"the server does not list {model}")
    status, _ = api(port, "/models", key=None)
    check(status == 401, f"without the key: {status}")
    status, answer = api(port, "/chat/completions", {
        "model": model, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]})
    check(status == 200 and answer["choices"][0]["message"]["content"], f"chat completion: {status} {answer}")
    session.click("nav button[data-view=dashboard]")
    line = session.wait_for(
        "const d = [...document.querySelectorAll('#stats dt')].find(x => x.textContent === 'Local server');"
        " const v = d && d.nextElementSibling.textContent;"
        " return v && v.includes('2 served') ? v : null", timeout=10, what="the dashboard's server line")
    check(f"http://127.0.0.1:{port}/v1" in line and "API key required" in line, line)
    session.click("nav button[data-view=chat]")


def switch_model(session, port):
    """The chat header's model switcher loads the model in Perch's models directory again."""
    name = Path(os.environ["PERCH_MODEL"]).name
    session.click("nav button[data-view=chat]")
    session.wait_for(
        "return [...document.getElementById('chat-model').options]"
        f".some(o => o.textContent.startsWith({json.dumps(name)}))", what="the model in the switcher")
    session.execute(
        "const s = document.getElementById('chat-model');"
        " s.value = [...s.options].find(o => o.textContent.startsWith(arguments[0])).value;"
        " s.dispatchEvent(new Event('change'));", name)
    session.wait_for(f"return document.getElementById('model-status').textContent === 'Model: {name}'",
                     timeout=60, what="the switched model to load")
    session.screenshot(OUT / "chat-switched.png")
    check(served_model_id(port) == [name], f"the server does not follow the switch to {name}")


def second_run(session, shown, port):
    titles = session.wait_for(
        "const b = [...document.querySelectorAll('#conversation-list button')];"
        " return b.length ? b.map(x => x.textContent) : null",
        what="the conversations list",
    )
    check(
        titles == [QUESTION[:60], "Write a short poem about the sea."],
        f"conversations after restart: {titles!r}",
    )
    session.wait_for(
        "return document.querySelectorAll('#messages > li').length === 2", what="the saved messages"
    )
    check(text(session, "#messages > li.user .body") == QUESTION, "the question was not kept")
    check(text(session, "#messages > li.assistant .body") == shown, "the stopped answer changed")
    check(text(session, "#messages > li.assistant .meta").endswith("stopped"), "finish reason lost")
    session.screenshot(OUT / "chat-after-restart.png")
    # The server setting was kept: it listens from the start and serves the model loaded then.
    model = loaded_model(session)
    check(served_model_id(port) == [model], f"after the restart the server does not list {model}")


def drawn(session):
    """The page's script has drawn the window (Preact draws it into the empty body after load)."""
    session.wait_for("return document.getElementById('view-chat') !== null", what="the page drawn")


def main():
    check(APP.is_file(), f"{APP} is missing: build the app first (cargo build -p perch-app)")
    # The app inherits tauri-driver's environment, where scripts/e2e.sh points PERCH_DATA_DIR
    # at a new empty directory: no earlier history can make the restart check pass.
    data_dir = Path(os.environ["PERCH_DATA_DIR"])
    check(not data_dir.exists() or not any(data_dir.iterdir()), f"{data_dir} must start empty")
    OUT.mkdir(parents=True, exist_ok=True)
    port = free_port()
    session = Session(DRIVER, APP)
    try:
        drawn(session)
        shown = first_run(session, port)
        model_picker(session)
        desktop_hooks(session)
        local_server(session, port)
        switch_model(session, port)
    except Exception:
        session.screenshot(OUT / "failure-first-run.png")
        raise
    finally:
        session.close()
    session = Session(DRIVER, APP)
    try:
        drawn(session)
        second_run(session, shown, port)
    except Exception:
        session.screenshot(OUT / "failure-second-run.png")
        raise
    finally:
        session.close()
    print("e2e: 5 passed (the first-run screen; streaming, dashboard graphs and Stop; the model picker's download and load; the chat's model switcher;"
          " global shortcut and launch at login; the local server from Settings and the dashboard;"
          " the conversation and the server after a restart)")


if __name__ == "__main__":
    main()
