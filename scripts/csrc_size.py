#!/usr/bin/env python3
"""The size rules of the C core: no file over MAX_FILE lines, no function
over MAX_FUNC lines.  Prints every breach (and, with -v, every file and the
longest functions); exits 1 if there is one.

    scripts/csrc_size.py [-v] [ROOT]
"""
import pathlib
import re
import sys

MAX_FILE = 1000
MAX_FUNC = 150

# A definition starts at column 0 with a name and "(" and its body opens
# with a "{" alone at column 0 (the core's style); it ends at the next "}"
# alone at column 0.
DEF = re.compile(r"^[A-Za-z_][\w \*]*?\b(\w+)\s*\(")


def functions(path):
    """(name, first line, length in lines) of each function defined in path."""
    lines = pathlib.Path(path).read_text().split("\n")
    out, name, start = [], None, 0
    for i, line in enumerate(lines, 1):
        m = DEF.match(line)
        if m and not line.rstrip().endswith(";"):
            name, start = m.group(1), i
        elif line == "{" and name is None:
            continue
        elif line == "}" and name is not None:
            out.append((name, start, i - start + 1))
            name = None
    return out


def breaches(root):
    root = pathlib.Path(root)
    found = []
    for path in sorted(root.glob("csrc/**/*.[ch]")):
        n = len(path.read_text().split("\n")) - 1
        rel = path.relative_to(root)
        if n > MAX_FILE:
            found.append(f"{rel}: {n} lines (more than {MAX_FILE})")
        if path.suffix == ".c":
            for name, start, length in functions(path):
                if length > MAX_FUNC:
                    found.append(f"{rel}:{start}: {name} has {length} lines (more than {MAX_FUNC})")
    return found


def main(argv):
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    root = args[0] if args else pathlib.Path(__file__).resolve().parent.parent
    if verbose:
        for path in sorted(pathlib.Path(root).glob("csrc/**/*.[ch]")):
            fns = functions(path) if path.suffix == ".c" else []
            longest = max(fns, key=lambda f: f[2]) if fns else None
            n = len(path.read_text().split("\n")) - 1
            print(f"{n:6d} {path.relative_to(root)}"
                  + (f"  (longest: {longest[0]} {longest[2]})" if longest else ""))
    found = breaches(root)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
