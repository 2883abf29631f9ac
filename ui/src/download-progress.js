// A download's progress as the model picker and the first run show it: a bar and a line ("40% of
// 2.3 GB (file 1 of 4)"), moved in place as DownloadProgress events arrive (ten a second).

import { describeDownload } from "./format.js";

/** `{bar, text, show(progress)}` for repository `repo`; `show` moves both. */
export function downloadProgress(doc, repo, progress = { bytes_done: 0, bytes_total: 0 }) {
  const bar = doc.createElement("progress");
  bar.max = 1;
  bar.setAttribute("aria-label", `Downloading ${repo}`);
  const text = doc.createElement("span");
  text.className = "progress-text";
  const show = (p) => {
    bar.value = p.bytes_total ? p.bytes_done / p.bytes_total : 0;
    text.textContent = ` ${describeDownload(p)} `;
  };
  show(progress);
  return { bar, text, show };
}
