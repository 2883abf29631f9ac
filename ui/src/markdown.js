// Model answers as Markdown: parsed by marked, sanitized by DOMPurify (the model's text is
// untrusted), code blocks highlighted by highlight.js when they name a language it knows, with
// a copy button on each. Links are shown but not followed: the web view must never navigate
// away from the app.

import { Marked } from "marked";
import DOMPurify from "dompurify";
import hljs from "highlight.js/lib/core";
import bash from "highlight.js/lib/languages/bash";
import c from "highlight.js/lib/languages/c";
import cpp from "highlight.js/lib/languages/cpp";
import css from "highlight.js/lib/languages/css";
import diff from "highlight.js/lib/languages/diff";
import go from "highlight.js/lib/languages/go";
import java from "highlight.js/lib/languages/java";
import javascript from "highlight.js/lib/languages/javascript";
import json from "highlight.js/lib/languages/json";
import markdown from "highlight.js/lib/languages/markdown";
import python from "highlight.js/lib/languages/python";
import rust from "highlight.js/lib/languages/rust";
import sql from "highlight.js/lib/languages/sql";
import swift from "highlight.js/lib/languages/swift";
import typescript from "highlight.js/lib/languages/typescript";
import xml from "highlight.js/lib/languages/xml";
import yaml from "highlight.js/lib/languages/yaml";

// The languages people ask local models about most; each registers its aliases too (js, py, sh,
// html, ...). Others stay plain text: a small bundle, and no guessing.
const LANGUAGES = { bash, c, cpp, css, diff, go, java, javascript, json, markdown, python, rust, sql, swift, typescript, xml, yaml };
for (const [name, language] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, language);

/** Highlights `code` (a `<code class="language-x">` element) in place when highlight.js knows x. */
export function highlightCode(code) {
  const language = [...code.classList].find((c) => c.startsWith("language-"))?.slice("language-".length);
  if (!language || !hljs.getLanguage(language)) return false;
  // highlight.js escapes the text and adds only <span class="hljs-...">.
  code.innerHTML = hljs.highlight(code.textContent, { language, ignoreIllegals: true }).value;
  code.classList.add("hljs");
  return true;
}

const parser = new Marked({ gfm: true, breaks: true });

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("title", node.getAttribute("href") ?? "");
    node.removeAttribute("href");
  }
});

/** Sanitized HTML for Markdown `text`. */
export function markdownToHtml(text) {
  const html = parser.parse(text, { async: false });
  return DOMPurify.sanitize(html, {
    FORBID_TAGS: ["style", "form", "input", "button", "img", "iframe"],
    FORBID_ATTR: ["style"],
  });
}

/** Copies `text` to the clipboard; falls back to a selection where the API is missing. */
export async function copyText(text, doc = document) {
  if (doc.defaultView?.navigator?.clipboard?.writeText) {
    try {
      await doc.defaultView.navigator.clipboard.writeText(text);
      return true;
    } catch {
      // Denied (not a secure context, no focus): use the selection below.
    }
  }
  const area = doc.createElement("textarea");
  area.value = text;
  doc.body.append(area);
  area.select();
  const copied = doc.execCommand?.("copy") ?? false;
  area.remove();
  return copied;
}

/** Renders Markdown `text` into `element`, code highlighted, with a "Copy" button on each block. */
export function renderMarkdown(element, text) {
  element.innerHTML = markdownToHtml(text);
  for (const pre of element.querySelectorAll("pre")) {
    const code = pre.querySelector("code");
    if (code) highlightCode(code);
    const button = element.ownerDocument.createElement("button");
    button.type = "button";
    button.className = "copy";
    button.textContent = "Copy";
    button.addEventListener("click", async () => {
      const copied = await copyText(pre.querySelector("code")?.textContent ?? pre.textContent, element.ownerDocument);
      button.textContent = copied ? "Copied" : "Copy failed";
      setTimeout(() => (button.textContent = "Copy"), 1500);
    });
    pre.before(button);
    const wrapper = element.ownerDocument.createElement("div");
    wrapper.className = "code-block";
    button.before(wrapper);
    wrapper.append(button, pre);
  }
}
