"""Command line: python -m kvrecv {demo,doctor}."""

from __future__ import annotations

import sys

USAGE = ("usage: python -m kvrecv demo [options]     (python -m kvrecv demo --help)\n"
         "       python -m kvrecv doctor [options]   (python -m kvrecv doctor --help)")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "demo":
        from .demo import run

        return run(rest)
    if cmd == "doctor":
        from .doctor import run

        return run(rest)
    print(f"unknown command {cmd!r}; try: demo, doctor", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
