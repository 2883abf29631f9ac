// Errors in plain words: one sentence that says what happened and what to do, the raw detail
// (the command's own message: a URL, an OS error) behind a "Details" disclosure
// (<ErrorMessage>, src/error-message.jsx, shows it).

/** Sentences for the kinds of CommandError (src/api.js) whose own message is technical. */
const PLAIN = {
  network: "Perch can't reach the Hugging Face Hub. Check your internet connection, then try again.",
  storage: "Perch couldn't read or write its files. Check that the disk has room and Perch may write there, then try again.",
  overloaded: "The model is busy with other requests. Try again in a moment.",
  internal: "Something went wrong inside Perch. Try again; if it keeps happening, restart Perch.",
};

/** OS and Perch wordings of a full disk (ENOSPC, Perch's own check before a download). */
const DISK_FULL = /no space left on device|disk is full|not enough disk space|ENOSPC|os error 28/i;

/**
 * `{sentence, detail}` for an error: a CommandError ({kind, message}), an Error or a string. A full
 * disk is said as such whatever the kind; kinds whose message is technical get a plain sentence
 * with the message as the detail; the rest (invalid input, a model that does not fit or is not
 * supported, a conversation too long) already are sentences for the user, shown as they are.
 */
export function describeError(error) {
  const raw = String(error?.message ?? error ?? "").trim() || "Unknown error.";
  if (DISK_FULL.test(raw)) {
    return { sentence: "The disk is full. Free some space, then try again.", detail: raw };
  }
  const plain = PLAIN[error?.kind];
  return plain ? { sentence: plain, detail: raw } : { sentence: raw, detail: null };
}
