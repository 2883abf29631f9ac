// A download's progress as the model picker and the first run show it: a bar and a line ("40% of
// 2.3 GB (file 1 of 4)"), redrawn as DownloadProgress events arrive (ten a second).

import { describeDownload } from "./format.js";

/** The bar and line of repository `repo`'s download (`progress`: DownloadProgress). */
export function DownloadProgress({ repo, progress = { bytes_done: 0, bytes_total: 0 } }) {
  return (
    <>
      <progress max={1} value={progress.bytes_total ? progress.bytes_done / progress.bytes_total : 0} aria-label={`Downloading ${repo}`} />
      <span class="progress-text">{` ${describeDownload(progress)} `}</span>
    </>
  );
}
