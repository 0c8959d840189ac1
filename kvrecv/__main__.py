"""Command line: python -m kvrecv {demo}."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m kvrecv demo [options]   (python -m kvrecv demo --help)")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import run

        return run(rest)
    print(f"unknown command {cmd!r}; try: demo", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
