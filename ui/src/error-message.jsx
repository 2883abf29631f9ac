// An error as the views show it: its plain sentence, then a closed "Details" disclosure with the
// raw detail when there is one (src/errors.js says which).

import { useErrorBoundary } from "preact/hooks";
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

/** Draws `children`; if drawing them throws, says so once (with Try again) instead of letting
 * the error escape, where it would become a notice and redraw the same failure again. */
export function Boundary({ children }) {
  const [error, reset] = useErrorBoundary();
  if (!error) return children;
  return (
    <div role="alert" class="notice">
      <ErrorMessage error={error} as="span" />{" "}
      <button type="button" onClick={reset}>Try again</button>
    </div>
  );
}
