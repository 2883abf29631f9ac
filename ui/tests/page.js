// The app's page (index.html's body) in jsdom, for view tests.
import { readFileSync } from "node:fs";
import { join } from "node:path";

const html = readFileSync(join(process.cwd(), "index.html"), "utf8");

export function loadPage() {
  document.body.innerHTML = html.slice(html.indexOf("<body>") + "<body>".length, html.indexOf("</body>"));
}
