// An answer's body: Markdown rendered by src/markdown.js (marked, sanitized by DOMPurify, code
// highlighted, a Copy button per block) into an element Preact leaves alone otherwise.

import { useLayoutEffect, useRef } from "preact/hooks";
import { renderMarkdown } from "./markdown.js";

/** `text`: Markdown; rendered again only when it changes. */
export function Markdown({ text }) {
  const body = useRef(null);
  useLayoutEffect(() => renderMarkdown(body.current, text), [text]);
  return <div class="body" ref={body} />;
}
