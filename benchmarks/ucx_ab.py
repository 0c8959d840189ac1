"""UCX settings A/B in one script: kvrecv under each set of UCX variables
(an arm) and NIXL, one round each in turn, on the throughput points of
run.py's grid, so that the arms are compared rounds a fraction of a second
apart on a shared host.

    python benchmarks/ucx_ab.py [--rounds N] [--tls tcp|shm] [--only NAME] [--no-nixl]
                                [--arm NAME=VAR=VALUE,VAR=VALUE ...] [--out FILE]

Without --arm: "default", kvrecv with its default tcp fragment sizes
(UCX_TCP_TX_SEG_SIZE=256K, UCX_TCP_RX_SEG_SIZE=512K), and "512k", the
512 KiB fragments into 1 MiB buffers measured as an opt-in (README).  A
variable an arm sets wins over kvrecv's own setting of it (ucxtune.c); an
arm that sets PYTHONPATH to another source tree with its own in-place build
runs that build (README, tcp messages: the build before a change against
the one after).  Prints per point each arm's median GB/s, median CPU s/GB
of both processes, its longest send() call and its round-by-round ratio
to NIXL (median), and writes benchmarks/results/ucx_ab.json (or --out, a
name in that folder).  Needs what run.py needs (NIXL optional)."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common as C  # noqa: E402
import run as R  # noqa: E402
from cma_ab import arm_rows, round_ratio, rounds_in_turn  # noqa: E402

DEFAULT_ARMS = {"default": {"UCX_TCP_TX_SEG_SIZE": "256K", "UCX_TCP_RX_SEG_SIZE": "512K"},
                "512k": {"UCX_TCP_TX_SEG_SIZE": "512K", "UCX_TCP_RX_SEG_SIZE": "1M"}}


def parse_arm(text):
    name, _, rest = text.partition("=")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, env


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tls", choices=("tcp", "shm"), default="tcp")
    ap.add_argument("--only", default="", help="points whose name contains this")
    ap.add_argument("--no-nixl", action="store_true")
    ap.add_argument("--out", default="ucx_ab.json", help="results file (benchmarks/results/)")
    ap.add_argument("--arm", action="append", default=[],
                    help="NAME=VAR=VALUE,VAR=VALUE (repeatable); replaces the default arms")
    a = ap.parse_args()
    arms = dict(parse_arm(x) for x in a.arm) if a.arm else DEFAULT_ARMS
    points = [p for p in R.throughput_points(False) if a.only in C.point_name(p)]
    tls, tmp = C.TRANSPORTS[a.tls], tempfile.mkdtemp()
    srv = {name: R.Server("kv_bench.py", tls, tmp, env) for name, env in arms.items()}
    if not a.no_nixl:
        srv["nixl"] = R.Server("nixl_bench.py", tls if a.tls == "tcp" else C.NIXL_SHM_TLS, tmp,
                               {"KVBENCH_NIXL_PROG_THREAD": "0"})
    out = {"tls": a.tls, "rounds": a.rounds, "arms": arms, "points": {}}
    try:
        for p in points:
            got = rounds_in_turn(srv, p, a.rounds)
            row = arm_rows(got, p)
            for k in arms if "nixl" in got else ():
                row[k]["per_nixl"] = round_ratio(got, k, "nixl")
            out["points"][C.point_name(p)] = row
            print(C.point_name(p), " ".join(
                f"{k}: {statistics.median(v['gbps']):.3f} GB/s"
                + (f" {statistics.median(v['cpu_s_per_gb']):.2f} CPU s/GB"
                   f" send() <= {max(v['send_max_ms']):.1f} ms" if k != "nixl" else "")
                + (f" {v['per_nixl'][0]:.2f}x NIXL" if v.get("per_nixl") else "")
                for k, v in row.items() if v["gbps"]), flush=True)
    finally:
        for s in srv.values():
            s.close()
    C.save_result(a.out, out)


if __name__ == "__main__":
    main()
