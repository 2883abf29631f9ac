// Exit 0 when two package-lock.json files name the same packages at the same versions apart from
// optional ones (platform builds the registry may or may not offer); exit 1 and print the first
// difference otherwise. Used by build-ui.sh.
import { readFileSync } from "node:fs";

const [a, b] = process.argv.slice(2).map((p) => JSON.parse(readFileSync(p, "utf8")));
const required = (lock) =>
  Object.fromEntries(
    Object.entries(lock.packages ?? {})
      .filter(([, meta]) => !meta.optional)
      .map(([path, meta]) => [path, JSON.stringify({ ...meta, optionalDependencies: undefined })]),
  );
const ra = required(a);
const rb = required(b);
for (const path of new Set([...Object.keys(ra), ...Object.keys(rb)])) {
  if (ra[path] !== rb[path]) {
    console.error(`lock-diff: ${path || "(root)"} differs`);
    process.exit(1);
  }
}
