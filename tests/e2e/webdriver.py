"""A minimal W3C WebDriver client (JSON over HTTP) for driving Perch's real web view through
tauri-driver and WebKitWebDriver. Only what the end-to-end test needs."""

import base64
import http.client
import json
import time
import urllib.error
import urllib.request


class WebDriverError(RuntimeError):
    pass


class Session:
    def __init__(self, url, application, env=None):
        self.url = url.rstrip("/")
        options = {"application": str(application)}
        if env:
            options["env"] = env
        caps = {"capabilities": {"alwaysMatch": {"tauri:options": options}}}
        value = self._call("POST", "/session", caps)
        self.id = value["sessionId"]

    def _call(self, method, path, body=None, attempts=3):
        data = json.dumps(body if body is not None else {}).encode() if method == "POST" else None
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.load(response)["value"]
        except urllib.error.HTTPError as err:
            raise WebDriverError(f"{method} {path}: {err.read().decode(errors='replace')}") from None
        except (http.client.RemoteDisconnected, ConnectionResetError):
            # tauri-driver sometimes forwards a request on a connection WebKitWebDriver has
            # already closed ("connection reset"), before the request reached the page: retry.
            if attempts <= 1:
                raise
            time.sleep(0.2)
            return self._call(method, path, body, attempts - 1)

    def call(self, method, path, body=None):
        return self._call(method, f"/session/{self.id}{path}", body)

    def execute(self, script, *args):
        """Runs `script` (a function body; `arguments` holds args) in the page, returns its value."""
        return self.call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def execute_async(self, script, *args):
        return self.call("POST", "/execute/async", {"script": script, "args": list(args)})

    def find(self, css):
        found = self.call("POST", "/element", {"using": "css selector", "value": css})
        return next(iter(found.values()))

    def click(self, css):
        self.call("POST", f"/element/{self.find(css)}/click")

    def type(self, css, text):
        self.call("POST", f"/element/{self.find(css)}/value", {"text": text})

    def screenshot(self, path):
        with open(path, "wb") as out:
            out.write(base64.b64decode(self.call("GET", "/screenshot")))

    def wait_for(self, script, timeout=120, interval=0.2, what=None):
        """Polls `script` until it returns something truthy; returns that. A script that throws
        (an element the page has not drawn yet) counts as not yet; its last error is in the
        timeout's message."""
        deadline = time.monotonic() + timeout
        last_error = None
        while True:
            try:
                value = self.execute(script)
            except WebDriverError as err:
                if "javascript error" not in str(err):
                    raise
                value, last_error = None, err
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what or script}"
                                   + (f" (last: {last_error})" if last_error else ""))
            time.sleep(interval)

    def close(self):
        try:
            self._call("DELETE", f"/session/{self.id}")
        except (WebDriverError, OSError):
            pass
