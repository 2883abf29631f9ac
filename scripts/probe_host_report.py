"""Reads what `scripts/probe_host.c` wrote (stacks of one thread, each frame `module+offset`, with
their counts) and prints where the thread's samples fall: by the function they were in (self), by
every function on their stacks (total), and by the first frame in libmlx or the executable (what
Perch or MLX called). Symbols come from `addr2line -f -C` on the modules given:

    python scripts/probe_host_report.py probe.txt target/release/perch /path/to/libmlx.so [--top 40] [--within NAME]
"""
import argparse
import collections
import os
import subprocess


def symbolize(modules, wanted):
    names = {}
    for base, addrs in wanted.items():
        path = modules.get(base)
        if not path:
            for a in addrs:
                names[(base, a)] = base
            continue
        addrs = sorted(addrs)
        out = subprocess.run(["addr2line", "-f", "-C", "-e", path] + [hex(a - 1 if a else a) for a in addrs],
                             capture_output=True, text=True, check=True).stdout.splitlines()
        for i, a in enumerate(addrs):
            fn = out[2 * i] if 2 * i < len(out) else "??"
            names[(base, a)] = fn if fn != "??" else f"{base}+{a:#x}"
    return names


def short(name, width=150):
    return name if len(name) <= width else name[: width - 1] + "…"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("probe")
    ap.add_argument("modules", nargs="*")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--within", help="only the samples with a function whose name contains this on their stack")
    args = ap.parse_args()
    modules = {os.path.basename(m): m for m in args.modules}
    stacks, header = [], []
    for line in open(args.probe):
        if line.startswith("#"):
            header.append(line.rstrip())
            continue
        count, *frames = line.split()
        parsed = []
        for f in frames:
            if f == "|":
                parsed.append(None)
                continue
            base, off = f.rsplit("+", 1)
            parsed.append((base, int(off, 16)))
        stacks.append((int(count), parsed))
    wanted = collections.defaultdict(set)
    for _, frames in stacks:
        for f in frames:
            if f:
                wanted[f[0]].add(f[1])
    names = symbolize(modules, wanted)
    total = sum(c for c, _ in stacks)
    self_time, inclusive, caller = collections.Counter(), collections.Counter(), collections.Counter()
    if args.within:
        stacks = [(c, fr) for c, fr in stacks if any(f and args.within in names[f] for f in fr)]
        total = sum(c for c, _ in stacks)
        header.append(f"# within {args.within}")
    for count, frames in stacks:
        named = [names[f] if f else "|" for f in frames]
        self_time[named[0]] += count
        for n in set(named):
            if n != "|":
                inclusive[n] += count
        # The first frame in the executable or libmlx, with the leaf's module.
        leaf_module = frames[0][0] if frames[0] else "?"
        first = next((names[f] for f in frames if f and f[0] in modules), "(none)")
        caller[f"{leaf_module} <- {first}"] += count
    print("\n".join(header))
    print(f"{total} samples")
    for title, counter in (("self", self_time), ("total (on the stack)", inclusive),
                           ("leaf's module <- first frame in the given modules", caller)):
        print(f"\n== {title}")
        for name, c in counter.most_common(args.top):
            print(f"{100 * c / total:6.1f}%  {short(name)}")


if __name__ == "__main__":
    main()
