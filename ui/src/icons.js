// Icons (Lucide, ISC): drawn before the text of every element marked data-icon="name". They are
// decorative: each control keeps its text (or aria-label) as its name, the SVG is hidden from
// screen readers.

import { Activity, Boxes, createElement, Menu, MessageSquare, Plus, Send, Settings, Square } from "lucide";

const ICONS = {
  chat: MessageSquare,
  dashboard: Activity,
  models: Boxes,
  settings: Settings,
  "new-chat": Plus,
  send: Send,
  stop: Square,
  menu: Menu,
};

/** Adds the icon of each `[data-icon]` element under `root` (once). Returns how many were added. */
export function addIcons(root) {
  let added = 0;
  for (const element of root.querySelectorAll("[data-icon]")) {
    const icon = ICONS[element.dataset.icon];
    if (!icon || element.querySelector(":scope > svg.icon")) continue;
    element.prepend(createElement(icon, { width: 16, height: 16, class: "icon", "aria-hidden": "true", focusable: "false" }));
    added += 1;
  }
  return added;
}
