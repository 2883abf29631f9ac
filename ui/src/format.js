// Numbers as the UI shows them. Pure functions: tested in tests/format.test.js.

/** Bytes as MiB, no decimals ("512 MiB"); null or undefined as "—". */
export function mib(bytes) {
  if (bytes == null) return "—";
  return `${(bytes / 2 ** 20).toFixed(0)} MiB`;
}

/**
 * One line under an answer: tokens, TTFT, decode tok/s, prompt tokens from the prefix cache, the
 * share of a draft model's proposals accepted (speculative decoding), and the finish reason when
 * it is not a normal end. `stats` is the engine's GenerationStats.
 */
export function describeStats(stats, finishReason) {
  const parts = [`${stats.generation_tokens} tokens`];
  parts.push(`TTFT ${(stats.ttft_s * 1000).toFixed(0)} ms`);
  parts.push(`${stats.generation_tps.toFixed(1)} tok/s`);
  if (stats.cached_prompt_tokens) {
    parts.push(`${stats.cached_prompt_tokens} of ${stats.prompt_tokens} prompt tokens cached`);
  }
  if (stats.draft_tokens) {
    const rate = (100 * stats.accepted_draft_tokens) / stats.draft_tokens;
    parts.push(`draft ${rate.toFixed(0)}% accepted`);
  }
  if (finishReason === "cancelled") parts.push("stopped");
  else if (finishReason === "length" && stats.cut_for_memory) parts.push("cut short: out of KV memory");
  else if (finishReason === "length") parts.push("hit the token limit");
  return parts.join(" · ");
}

/** A number as short as it reads (f32 values from Rust: 0.8, not 0.800000011920929). */
function short(x) {
  return String(Number(x.toPrecision(4)));
}

/**
 * The sampling an answer was generated with, in a line: `sampling` is perch-store's
 * AnswerSampling ({params: SamplingParams, source: "model" | "perch" | "custom"}). Samplers that
 * are off are left out.
 */
export function describeSampling(sampling) {
  const p = sampling.params;
  const parts = [];
  if (p.temperature > 0) {
    parts.push(`temperature ${short(p.temperature)}`);
    if (p.top_p > 0 && p.top_p < 1) parts.push(`top-p ${short(p.top_p)}`);
    if (p.top_k > 0) parts.push(`top-k ${p.top_k}`);
    if (p.min_p > 0) parts.push(`min-p ${short(p.min_p)}`);
    if (p.xtc_probability > 0) parts.push(`XTC ${short(p.xtc_probability)} above ${short(p.xtc_threshold)}`);
  } else {
    parts.push("greedy");
  }
  if (p.repetition_penalty > 0 && p.repetition_penalty !== 1) {
    parts.push(`repetition penalty ${short(p.repetition_penalty)}`);
  }
  if (p.presence_penalty) parts.push(`presence penalty ${short(p.presence_penalty)}`);
  if (p.frequency_penalty) parts.push(`frequency penalty ${short(p.frequency_penalty)}`);
  if (p.seed != null) parts.push(`seed ${p.seed}`);
  const source = {
    model: "the model's defaults",
    perch: "Perch's defaults",
    custom: "this conversation's settings",
  }[sampling.source];
  return source ? `${parts.join(", ")} (${source})` : parts.join(", ");
}

/** What the status line says about the model (`ModelStatus` from the `model_status` command). */
export function describeModelStatus(status, loadingSeconds = 0) {
  switch (status.state) {
    case "not_loaded":
      return "No model loaded.";
    case "loading": {
      const seconds = `${loadingSeconds.toFixed(0)} s`;
      if (!status.bytes_total) return `Loading ${status.name}… ${seconds}`;
      const percent = Math.floor((100 * status.bytes_read) / status.bytes_total);
      return `Loading ${status.name}… ${percent}% of ${mib(status.bytes_total)}, ${seconds}`;
    }
    case "loaded":
      return `Model: ${status.name}`;
    case "failed":
      return `Could not load ${status.name}: ${status.error}`;
    default:
      return "";
  }
}

/** Bytes in decimal units, as the Hugging Face Hub shows sizes ("1.2 GB", "850 MB"). */
export function decimalBytes(bytes) {
  const units = ["B", "kB", "MB", "GB", "TB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return unit === 0 ? `${bytes} B` : `${value.toFixed(value < 10 ? 1 : 0)} ${units[unit]}`;
}

/**
 * What `MemoryFit` means for a model divided over the hosts of Settings → Hosts (`group_fit`);
 * "" without hosts or a reading of them (null).
 */
export function describeGroupFit(fit) {
  switch (fit) {
    case "fits":
      return "fits your hosts";
    case "tight":
      return "fits your hosts with a smaller KV cache";
    case "too_large":
      return "too large for your hosts";
    case "unknown":
      return "fit on your hosts unknown";
    default:
      return "";
  }
}

/** What `MemoryFit` (perch-hub's fit.rs) means for the user. */
export function describeFit(fit) {
  switch (fit) {
    case "fits":
      return "fits in memory";
    case "tight":
      return "fits with a smaller KV cache";
    case "too_large":
      return "too large for this machine";
    default:
      return "fit unknown";
  }
}

/**
 * How long a conversation the KV cache budget holds for a model (`context_tokens` of a search
 * result: from its config's KV bytes per token), as " · holds N tokens" to follow the fit; empty
 * when unknown.
 */
export function describeContext(tokens) {
  if (tokens == null) return "";
  return ` · KV cache holds ${tokens.toLocaleString("en-US")} tokens`;
}

/** A download's progress (`DownloadProgress` from the `download_model` channel). */
export function describeDownload(progress) {
  if (!progress.bytes_total) return "Starting…";
  const percent = Math.floor((100 * progress.bytes_done) / progress.bytes_total);
  return `${percent}% of ${decimalBytes(progress.bytes_total)} (file ${Math.min(progress.files_done + 1, progress.files_total)} of ${progress.files_total})`;
}
