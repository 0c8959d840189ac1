"""Command line: python -m kvrecv {demo,doctor,bench}."""

from __future__ import annotations

import sys

USAGE = ("usage: python -m kvrecv demo [options]     (python -m kvrecv demo --help)\n"
         "       python -m kvrecv doctor [options]   (python -m kvrecv doctor --help)\n"
         "       python -m kvrecv bench [options]    (benchmarks/run.py of a source checkout)\n"
         "       python -m kvrecv bench faults [options]   (benchmarks/faults.py)")


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
    if cmd == "bench":
        import os
        import subprocess

        name = "faults.py" if rest[:1] == ["faults"] else "run.py"
        rest = rest[1:] if name == "faults.py" else rest
        script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "benchmarks", name)
        if not os.path.exists(script):
            print(f"the benchmark suite ships with the source checkout (benchmarks/{name}), "
                  "not with an installed package", file=sys.stderr)
            return 2
        return subprocess.call([sys.executable, script, *rest])
    print(f"unknown command {cmd!r}; try: demo, doctor, bench", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
