// Model answers as Markdown: parsed by marked, sanitized by DOMPurify (the model's text is
// untrusted), with a copy button on every code block. Links are shown but not followed: the
// web view must never navigate away from the app.

import { Marked } from "marked";
import DOMPurify from "dompurify";

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

/** Renders Markdown `text` into `element`, with a "Copy" button on each code block. */
export function renderMarkdown(element, text) {
  element.innerHTML = markdownToHtml(text);
  for (const pre of element.querySelectorAll("pre")) {
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
