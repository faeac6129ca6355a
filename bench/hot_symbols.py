"""Writes the hot-symbol order file from callgrind profiles of the weir binary.

Usage: python3 bench/hot_symbols.py BINARY OUT PROFILE...
       python3 bench/hot_symbols.py --check BINARY LIST   (how much of LIST BINARY has)

Every function of BINARY that ran in any PROFILE (callgrind output written with
--demangle=no) is listed once, by its mangled name: first those the first PROFILE ran,
then those the second one added, and so on, each group in the order it lies in BINARY. lld then
places them first and together in `.text` (`--symbol-ordering-file`), so the code a batch
runs fills a few MB of pages instead of being spread over the whole binary (see
crates/weir-cli/build.rs).
"""

import os
import re
import subprocess
import sys


def executed(profile, binary_name):
    """Mangled names of the functions of `binary_name` that ran in one callgrind profile."""
    names, objects, current, ran = {}, {}, None, set()
    for line in open(profile, encoding="utf-8", errors="replace"):
        m = re.match(r"(c?ob)=\((\d+)\)(?: (.*))?", line)
        if m:
            kind, i, name = m.groups()
            if name:
                objects[i] = name.strip()
            if kind == "ob":
                current = objects.get(i)
            continue
        m = re.match(r"(c?fn)=\((\d+)\)(?: (.*))?", line)
        if m:
            kind, i, name = m.groups()
            if name:
                names[i] = name.strip()
            if kind == "fn" and current and os.path.basename(current) == binary_name:
                # A recursive function's deeper calls are named "f'2", "f'3", ...
                ran.add(names[i].split("'")[0])
    return ran


def symbols(binary):
    """(name, address) of every function BINARY defines."""
    nm = subprocess.run(
        ["nm", "--defined-only", binary], capture_output=True, text=True, check=True
    ).stdout
    for line in nm.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in "tTwW":
            yield parts[2], int(parts[0], 16)


def check(binary, listed):
    """Says how many names of the list BINARY defines: after renames, another rustc or
    other dependencies, fewer of them match and less of the hot code lies together."""
    names = [n for n in open(listed, encoding="utf-8").read().split() if n]
    defined = {name for name, _ in symbols(binary)}
    if not defined:
        print(f"{binary} has no symbol table (stripped): cannot tell", file=sys.stderr)
        return
    found = sum(1 for n in names if n in defined)
    share = found / len(names) if names else 0.0
    print(f"{listed}: {found} of {len(names)} listed functions are in {binary} ({share:.0%})")
    if share < 0.9:
        print(
            "  the list is stale for this build: run bench/hot_symbols.sh to lay the hot "
            "code out together again",
            file=sys.stderr,
        )


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--check":
        check(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) < 4 or sys.argv[1] == "--check":
        sys.exit(__doc__)
    binary, out, profiles = sys.argv[1], sys.argv[2], sys.argv[3:]
    first = {}
    for i, p in enumerate(profiles):
        names = executed(p, os.path.basename(binary))
        if not names:
            sys.exit(
                f"{p}: no function of {binary} ran in it (callgrind must write compressed "
                "names without demangling: --demangle=no, no --compress-strings=no)"
            )
        for name in names:
            first.setdefault(name, i)
    ran = set(first)
    address = {}
    for name, at in symbols(binary):
        if name in ran:
            address.setdefault(name, at)
    hot = sorted(address, key=lambda n: (first[n], address[n]))
    if len(hot) < len(ran) // 2:
        sys.exit(
            f"only {len(hot)} of the {len(ran)} functions that ran have a symbol in {binary} "
            "(a stripped binary?); not writing the list"
        )
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(hot) + "\n")
    print(f"{len(hot)} functions ran ({len(ran) - len(hot)} had no symbol); wrote {out}")


if __name__ == "__main__":
    main()
