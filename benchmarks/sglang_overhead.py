"""Per-request time kvrecv adds to sglang's scheduler loop, measured beside
sglang's own `fake` transfer backend in the same run.

sglang's unpatched queues run in separate rank processes
(tests/sglang_sched.py): decode's DecodePreallocQueue.add / pop_preallocated
and DecodeTransferQueue.pop_transferred / resolve_deferred_releases, prefill's
PrefillBootstrapQueue.add / pop_bootstrapped, send_kv_chunk and
process_disagg_prefill_inflight_queue.  Rounds alternate a batch of fake
requests (sglang's fake backend: no transfer at all) with a batch of kvrecv
requests; the wall time spent inside those methods, summed over the batch and
divided by its size, is the per-request cost.  The difference is what kvrecv
adds; it includes the loop iterations spent polling while bytes move.

Usage: PYTHONPATH=. python3 benchmarks/sglang_overhead.py [--tp 1] [--reqs 32]
[--tokens 64] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from sglang_sched import Driver, ReqSpec  # noqa: E402

DECODE = ("add", "pop_preallocated", "pop_transferred", "resolve_deferred_releases")
PREFILL = ("bootstrap_add", "pop_bootstrapped", "send_kv_chunk", "process_inflight")


def _per_req_us(reports, methods, n) -> float:
    """Mean over ranks of the time in `methods`, per request, in µs."""
    return statistics.mean(sum(r["time_s"].get(m, 0.0) for m in methods) / n * 1e6
                           for r in reports)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--reqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = {"fake": {"decode": [], "prefill": []}, "kvrecv": {"decode": [], "prefill": []}}
    with tempfile.TemporaryDirectory() as tmp:
        d = Driver(tmp, tp=a.tp)
        try:
            d.call("start_prefill")
            d.call("start_decode")
            room = 1
            for _ in range(a.rounds):
                for backend in ("fake", "kvrecv"):
                    specs = [ReqSpec(f"{backend}{room + i}", room + i, a.tokens,
                                     fake=backend == "fake") for i in range(a.reqs)]
                    room += a.reqs
                    out = d.run(specs)
                    for side in ("decode", "prefill"):
                        for r in out[side]:
                            if "raised" in r or "timeout" in r:
                                raise SystemExit(f"{backend} {side}: {r.get('raised') or r['timeout']}")
                    if backend == "kvrecv":
                        assert all(v["status"] == "ok" and v["bytes_ok"]
                                   for r in out["decode"] for v in r["reqs"].values())
                    rows[backend]["decode"].append(_per_req_us(out["decode"], DECODE, a.reqs))
                    rows[backend]["prefill"].append(_per_req_us(out["prefill"], PREFILL, a.reqs))
        finally:
            d.close()
    result = {"tp": a.tp, "reqs_per_batch": a.reqs, "tokens_per_req": a.tokens,
              "rounds": a.rounds}
    print(f"sglang scheduler methods, µs per request (median of {a.rounds} rounds of "
          f"{a.reqs} requests, {a.tokens} tokens, TP {a.tp}):")
    print(f"{'side':8} {'fake':>9} {'kvrecv':>9} {'added':>9} {'ratio':>7}")
    for side in ("decode", "prefill"):
        fake = statistics.median(rows["fake"][side])
        kv = statistics.median(rows["kvrecv"][side])
        result[side] = {"fake_us": round(fake, 1), "kvrecv_us": round(kv, 1),
                        "added_us": round(kv - fake, 1), "ratio": round(kv / fake, 2)}
        print(f"{side:8} {fake:9.1f} {kv:9.1f} {kv - fake:9.1f} {kv / fake:7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
