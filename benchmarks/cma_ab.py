"""Cross-memory reads A/B over shared memory, in one script: kvrecv without
them (cross_memory_bytes 0, the FIFO path), kvrecv with them at one or more
thresholds, and NIXL, one round each in turn, on the points where large
pieces lost to NIXL.

    python benchmarks/cma_ab.py [ROUNDS] [--read BYTES[,BYTES...]] [--only NAME] [--no-nixl]
                                [--tls shm|tcp] [--default]

Prints per point the median GB/s, the median CPU s/GB (both processes), the
share of bytes that came as reads, and the round-by-round ratios (median,
lowest, highest); writes benchmarks/results/cma_ab.json.  --only: the
points whose name contains NAME.  --default: one more kvrecv arm with
kvrecv's own default cross_memory_bytes ("default").  --tls tcp: the same
over UCX_TLS=tcp (NIXL over tcp too), where the reads must not be taken.  Needs what run.py needs (NIXL optional)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common as C  # noqa: E402
import run as R  # noqa: E402

KiB = 1024
POINTS = [
    {"layout": "contig", "nbuf": 64, "item": 4 * KiB, "pages": 256, "rooms": 2},   # 1 MiB runs
    {"layout": "contig", "nbuf": 32, "item": 4 * KiB, "pages": 1024, "rooms": 2},  # 4 MiB runs
    {"layout": "contig", "nbuf": 32, "item": 4 * KiB, "pages": 4096, "rooms": 1},  # 16 MiB runs
    {"layout": "contig", "nbuf": 64, "item": 64 * KiB, "pages": 16, "rooms": 2},   # 1 MiB runs of 64 KiB
    {"layout": "random", "nbuf": 64, "item": 64 * KiB, "pages": 16, "rooms": 2},   # 64 KiB pages
]


def one_round(srv, kind, point, i):
    req = {"cmd": "point" if kind == "nixl" else "throughput", "point": point,
           "rounds": 1, "warmup": 1 if i == 0 else 0, "reuse": i > 0}
    r = srv.request(req)
    if "error" in r:
        print(kind, C.point_name(point), "ERROR", str(r["error"])[-800:], flush=True)
        return None
    rr = r["rounds"][0] if r.get("rounds") else r
    return {"gbps": rr.get("gbps"), "verify": r.get("verify"),
            "cpu": (rr.get("decode_cpu") or 0) + (rr.get("prefill_cpu") or 0),
            "send_ms": max(rr["send_call_us"]) / 1e3 if rr.get("send_call_us") else None,
            "read_share": (rr["decode_cma_bytes"] / rr["decode_bytes"]
                           if rr.get("decode_bytes") and "decode_cma_bytes" in rr else None)}


def rounds_in_turn(srv, point, rounds):
    """{arm: [round result or None]}: every arm one round, in turn, rounds
    times over (the first round of each arm warms up)."""
    got = {k: [] for k in srv}
    for i in range(rounds):
        for k, s in srv.items():
            got[k].append(one_round(s, k, point, i))
    return got


def arm_rows(got, point):
    """Per arm, the figures of its rounds that moved data: GB/s, CPU s/GB
    of both processes, share read across memory, the longest send() call
    (kvrecv), the byte checks."""
    gb = C.round_bytes(point) / 1e9
    row = {}
    for k, v in got.items():
        ok = [x for x in v if x and x["gbps"]]
        row[k] = {"gbps": [x["gbps"] for x in ok],
                  "cpu_s_per_gb": [x["cpu"] / gb for x in ok],
                  "read_share": [x["read_share"] for x in ok],
                  "send_max_ms": [x.get("send_ms") for x in ok],
                  "verify": sorted({json.dumps(x["verify"]) for x in ok})}
    return row


def round_ratio(got, x, y):
    """[median, lowest, highest] of arm x's GB/s over arm y's, round by
    round (rounds taken in turn); None if no pair of rounds moved data."""
    rs = [u["gbps"] / w["gbps"] for u, w in zip(got[x], got[y])
          if u and w and u["gbps"] and w["gbps"]]
    return [statistics.median(rs), min(rs), max(rs)] if rs else None


def read_name(n: int) -> str:
    return f"read{n >> 20}M" if n % (1 << 20) == 0 else f"read{n >> 10}K"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", nargs="?", type=int, default=7)
    ap.add_argument("--read", default=str(256 * KiB),
                    help="cross_memory_bytes of the read runs, comma-separated")
    ap.add_argument("--only", default="", help="points whose name contains this")
    ap.add_argument("--no-nixl", action="store_true")
    ap.add_argument("--tls", choices=("shm", "tcp"), default="shm")
    ap.add_argument("--default", action="store_true",
                    help="also kvrecv with its default cross_memory_bytes")
    a = ap.parse_args()
    reads = [int(x) for x in a.read.split(",")]
    points = [p for p in POINTS if a.only in C.point_name(p)]
    tls, tmp = C.TRANSPORTS[a.tls], tempfile.mkdtemp()
    # KVConfig takes KVRECV_<FIELD> from the environment (both processes).
    srv = {"fifo": R.Server("kv_bench.py", tls, tmp, {"KVRECV_CROSS_MEMORY_BYTES": "0"})}
    for n in reads:
        srv[read_name(n)] = R.Server("kv_bench.py", tls, tmp,
                                     {"KVRECV_CROSS_MEMORY_BYTES": str(n)})
    if a.default:
        srv["default"] = R.Server("kv_bench.py", tls, tmp, {})
    if not a.no_nixl:
        srv["nixl"] = R.Server("nixl_bench.py", tls if a.tls == "tcp" else C.NIXL_SHM_TLS, tmp,
                               {"KVBENCH_NIXL_PROG_THREAD": "0"})
    out = {"rounds": a.rounds, "read_bytes": reads, "points": {}}
    try:
        for p in points:
            got = rounds_in_turn(srv, p, a.rounds)
            row = arm_rows(got, p)
            ratios = {}
            pairs = [(read_name(n), y) for n in reads for y in ("fifo", "nixl")] + [("fifo", "nixl")]
            pairs += [("default", "fifo"), ("default", "nixl")]
            for x, y in pairs:
                r = round_ratio(got, x, y) if x in got and y in got else None
                if r:
                    ratios[f"{x}/{y}"] = r
            out["points"][C.point_name(p)] = {"runs": row, "ratios": ratios}
            med = {k: round(statistics.median(v["gbps"]), 3) for k, v in row.items() if v["gbps"]}
            cpu = {k: round(statistics.median(v["cpu_s_per_gb"]), 3)
                   for k, v in row.items() if v["cpu_s_per_gb"]}
            share = {k: round(statistics.median(v["read_share"]), 2)
                     for k, v in row.items() if v["read_share"] and None not in v["read_share"]}
            print(C.point_name(p), "GB/s", med, "CPU s/GB", cpu, "read share", share,
                  "ratios med/min/max",
                  {k: [round(x, 2) for x in v] for k, v in ratios.items()},
                  "verify", {k: v["verify"] for k, v in row.items()}, flush=True)
    finally:
        for s in srv.values():
            s.close()
    C.save_result("cma_ab.json", out)


if __name__ == "__main__":
    main()
