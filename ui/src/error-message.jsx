// An error as the views show it: its plain sentence, then a closed "Details" disclosure with the
// raw detail when there is one (src/errors.js says which).

import { describeError } from "./errors.js";

/** `error`: a CommandError, an Error or a sentence; `as`: the element ("div", or "span" in a line). */
export function ErrorMessage({ error, as: Tag = "div" }) {
  const { sentence, detail } = describeError(error);
  return (
    <Tag class="error">
      {sentence}
      {detail && detail !== sentence && (
        <>
          {" "}
          <details>
            <summary>Details</summary>
            <code>{detail}</code>
          </details>
        </>
      )}
    </Tag>
  );
}
