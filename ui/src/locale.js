// WebKitGTK reports the POSIX locale "C" as navigator.language when LANG is unset or C, and
// Intl rejects "C" as a language tag; uPlot builds an Intl.NumberFormat for navigator.language
// when it loads, so the whole UI would fail to start. Imported first (see main.jsx): where the
// page's language is not a valid tag, Intl.NumberFormat falls back to the default locale.

const Native = Intl.NumberFormat;

/** Whether `tag` is a language tag Intl accepts. */
export function isValidLocale(tag) {
  try {
    new Native(tag);
    return true;
  } catch {
    return false;
  }
}

if (!isValidLocale(globalThis.navigator?.language)) {
  const Fallback = function NumberFormat(locales, options) {
    return new Native(isValidLocale(locales) ? locales : undefined, options);
  };
  Fallback.prototype = Native.prototype;
  Fallback.supportedLocalesOf = Native.supportedLocalesOf.bind(Native);
  Intl.NumberFormat = Fallback;
}
