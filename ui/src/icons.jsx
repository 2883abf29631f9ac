// Icons (Lucide, ISC, through lucide-preact): drawn before the text of a control. They are
// decorative: each control keeps its text (or aria-label) as its name, the SVG is hidden from
// screen readers. The controls that have one are marked data-icon="name" (style.css lays them out).

import { Activity, Boxes, ImagePlus, Menu, MessageSquare, Plus, Send, Settings, Square } from "lucide-preact";

export const ICONS = {
  chat: MessageSquare,
  dashboard: Activity,
  models: Boxes,
  settings: Settings,
  "new-chat": Plus,
  send: Send,
  stop: Square,
  menu: Menu,
  attach: ImagePlus,
};

/** The icon called `name` (a key of ICONS), 16 px. */
export function Icon({ name }) {
  const Svg = ICONS[name];
  return <Svg size={16} class="icon" aria-hidden="true" focusable="false" />;
}
