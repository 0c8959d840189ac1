"""Collapsing tcp rounds, side by side: kvrecv, NIXL and a plain tcp pair
over loopback, so that a slow phase of the host shows in all three or in
one library alone.

    python benchmarks/tcp_phases.py [--tries N] [--rounds R] [--no-nixl] [--out FILE]

Per try: R rounds of kvrecv and NIXL taken in turn at
contig-b64-i64k-p16-r2 (UCX_TLS=tcp; 128 MiB a round: two rooms of 64
runs of 1 MiB), then R rounds of tcp_pair.c moving the same bytes a round
with the write and read sizes of kvrecv's lanes (8 MiB sends, 256 KiB
reads, lane.c) under kvrecv's lane congestion control (reno).  A round
below half its library's median over the whole run counts as collapsed.
Prints per try and library the collapsed rounds and the lowest round;
writes benchmarks/results/tcp_phases.json (or --out, a name in that
folder).  Collapses come in phases of minutes (README, open findings): a
run right after the host idled for a quarter of an hour and one after
minutes of traffic differ.  Needs what run.py needs (NIXL optional)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common as C  # noqa: E402
import run as R  # noqa: E402
from cma_ab import one_round  # noqa: E402
from kvrecv import KVConfig  # noqa: E402

POINT = "contig-b64-i64k-p16-r2"
# As a lane writes and reads (lane.c: KVR_LANE_ROUND_BYTES, KVR_LANE_READ_MAX),
# under the lanes' default congestion control.
PAIR_SEND_KIB, PAIR_RECV_KIB = 8192, 256
PAIR_CC = KVConfig().lane_congestion


def pair_rounds(exe, point, rounds):
    """GB/s of each of `rounds` rounds of tcp_pair moving a round's bytes
    (after one more that warms its new connection up, unkept)."""
    mib = max(1, C.round_bytes(point) >> 20)
    p = subprocess.run([exe, str(mib), str(rounds + 1), str(PAIR_SEND_KIB), str(PAIR_RECV_KIB),
                        PAIR_CC], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"tcp_pair failed (rc {p.returncode}): {p.stderr[-500:]}")
    return json.loads(p.stdout)["gbps"][1:]


def summary(tries):
    """Per library: the median over every try, and per try the rounds below
    half of it and the lowest round."""
    out = {}
    for lib in tries[0]:
        every = [g for t in tries for g in t[lib]]
        med = statistics.median(every)
        out[lib] = {"median_gbps": med,
                    "tries": [{"collapsed": sum(1 for g in t[lib] if g < med / 2),
                               "rounds": len(t[lib]), "lowest_gbps": min(t[lib])}
                              for t in tries]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--no-nixl", action="store_true")
    ap.add_argument("--out", default="tcp_phases.json", help="results file (benchmarks/results/)")
    a = ap.parse_args()
    if a.tries < 1 or a.rounds < 2:
        ap.error("--tries must be at least 1 and --rounds at least 2")
    point = next(p for p in R.throughput_points(False) if C.point_name(p) == POINT)
    exe, _ = R.build_c("tcp_pair")
    tls, tmp = C.TRANSPORTS["tcp"], tempfile.mkdtemp()
    srv = {"kvrecv": R.Server("kv_bench.py", tls, tmp, {})}
    if not a.no_nixl:
        srv["nixl"] = R.Server("nixl_bench.py", tls, tmp, {"KVBENCH_NIXL_PROG_THREAD": "0"})
    tries, n = [], 0  # n: rounds taken per library; the first (n == 0) warms up, unkept
    try:
        for t in range(a.tries):
            got = {k: [] for k in srv}
            while len(got["kvrecv"]) < a.rounds:
                for k, s in srv.items():
                    r = one_round(s, k, point, n)
                    if r is None or not r["gbps"]:
                        raise RuntimeError(f"{k}: a round of {POINT} moved nothing")
                    if n:
                        got[k].append(r["gbps"])
                n += 1
            got["tcp_pair"] = pair_rounds(exe, point, a.rounds)
            tries.append(got)
            print(f"try {t + 1}: " + "  ".join(
                f"{k} {statistics.median(v):.2f} GB/s [lowest {min(v):.2f}]"
                for k, v in got.items()), flush=True)
    finally:
        for s in srv.values():
            s.close()
    res = summary(tries)
    for lib, r in res.items():
        print(f"{lib}: median {r['median_gbps']:.2f} GB/s; collapsed rounds per try "
              + ", ".join(f"{x['collapsed']}/{x['rounds']}" for x in r["tries"]))
    C.save_result(a.out, {"point": POINT, "rounds": a.rounds, "tries": tries, "summary": res,
                          "pair": {"send_kib": PAIR_SEND_KIB, "recv_kib": PAIR_RECV_KIB,
                                   "congestion": PAIR_CC}})


if __name__ == "__main__":
    main()
