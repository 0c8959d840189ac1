"""Where a one-page room's latency goes: the thread wake-ups and the time
off the CPU between the prefill's send() and the decode's poll() seeing
Success, from the kernel's scheduler events (tracefs, root).

    python benchmarks/handoffs.py [--runs N] [--samples N] [--tls shm,tcp]

Runs the latency benchmark's one-page rooms (kv_bench.py, the same rooms and
clocks as run.py's latency section) with sched_switch and sched_wakeup
traced on CLOCK_MONOTONIC, then for each room's window [t0, t1] counts:

- wake-ups of each thread of the two processes (by thread name: the
  engine threads kvr-prefill0 / kvr-decode0, ZMQ's I/O threads, the Python
  threads), and when in the window the decode's engine thread was first
  woken;
- how long the decode's polling thread (the one that calls poll()) was off
  the CPU while it could run (preempted), and by which threads;
- UCX events per room that poll() handled on the polling thread itself
  (poll_progress), i.e. rooms whose data needed no engine thread.

Prints a table per case (median over rooms; p50/p99 of the latency) and
writes benchmarks/results/handoffs.json.  Not part of run.py: it needs root
and changes the tracing settings while it runs (restored after)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common as C  # noqa: E402
import run as R  # noqa: E402

TRACE = "/sys/kernel/tracing"
LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+): (sched_\w+): (.*)$")


def _write(name, value):
    with open(os.path.join(TRACE, name), "w") as f:
        f.write(value)


def _read(name):
    with open(os.path.join(TRACE, name)) as f:
        return f.read()


class Tracing:
    """sched_switch + sched_wakeup on the monotonic clock, as a context."""

    def __enter__(self):
        clock = _read("trace_clock")
        self.clock = re.search(r"\[(\w+)\]", clock).group(1)
        self.size = _read("buffer_size_kb").split()[0]
        _write("tracing_on", "0")
        _write("trace_clock", "mono")
        _write("buffer_size_kb", "65536")
        _write("trace", "")
        for ev in ("sched_switch", "sched_wakeup"):
            _write(f"events/sched/{ev}/enable", "1")
        _write("tracing_on", "1")
        return self

    def __exit__(self, *exc):
        _write("tracing_on", "0")
        self.text = _read("trace")
        for ev in ("sched_switch", "sched_wakeup"):
            _write(f"events/sched/{ev}/enable", "0")
        _write("trace", "")
        _write("buffer_size_kb", self.size)
        _write("trace_clock", self.clock)


def parse(text):
    """[(ns, kind, fields)] in time order."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        ns = round(float(m.group(4)) * 1e9)
        f = dict(re.findall(r"(\w+)=(\S+)", m.group(6)))
        out.append((ns, m.group(5), f))
    out.sort(key=lambda x: x[0])
    return out


def thread_names(pids):
    """{tid: (side, name)} of every thread of the decode and prefill
    processes (read while they live)."""
    out = {}
    for side, pid in zip(("decode", "prefill"), pids):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[int(tid)] = (side, f.read().strip())
    return out


def _kind(tid, threads, poller):
    side, name = threads[tid]
    if tid == poller:
        return "decode poll() thread"
    return f"{side} {'ZMQ I/O' if name.startswith('ZMQbg') else name}"


def preemptions(events, threads, poller):
    """[(off_ns, on_ns, what ran instead)]: each time the polling thread was
    switched out while it could still run, until it ran again."""
    out, off = [], None
    for ns, kind, f in events:
        if kind != "sched_switch":
            continue
        prev, nxt = int(f.get("prev_pid", -1)), int(f.get("next_pid", -1))
        if prev == poller and f.get("prev_state", "").startswith("R"):
            off = (ns, _kind(nxt, threads, poller) if nxt in threads else f.get("next_comm", "?"))
        elif nxt == poller and off is not None:
            out.append((off[0], ns, off[1]))
            off = None
    return out


def analyse(events, spans, threads, poller):
    """Per room: wake-ups per thread kind, when the decode's engine thread
    was first woken (us after t0), how long the polling thread was
    preempted within the room's window (us) and what ran instead."""
    rooms = []
    pre = preemptions(events, threads, poller)
    i = k = 0
    for t0, t1 in spans:
        while i < len(events) and events[i][0] < t0:
            i += 1
        while k < len(pre) and pre[k][1] < t0:
            k += 1
        wakes, by = collections.Counter(), collections.Counter()
        first_engine = None
        j = i
        while j < len(events) and events[j][0] <= t1:
            ns, kind, f = events[j]
            j += 1
            tid = int(f.get("pid", -1))
            if kind == "sched_wakeup" and tid in threads:
                wakes[_kind(tid, threads, poller)] += 1
                if threads[tid][1].startswith("kvr-decode") and first_engine is None:
                    first_engine = (ns - t0) / 1e3
        preempted = 0.0
        m = k
        while m < len(pre) and pre[m][0] <= t1:
            overlap = min(pre[m][1], t1) - max(pre[m][0], t0)
            if overlap > 0:
                preempted += overlap / 1e3
                by[pre[m][2]] += 1
            m += 1
        rooms.append({"us": (t1 - t0) / 1e3, "wakes": dict(wakes), "engine_woken_us": first_engine,
                      "poller_preempted_us": preempted, "preempted_by": dict(by)})
    return rooms


def summarize(rooms):
    kinds = sorted({k for r in rooms for k in r["wakes"]})
    woken = [r["engine_woken_us"] for r in rooms if r["engine_woken_us"] is not None]
    by = collections.Counter()
    for r in rooms:
        by.update(r["preempted_by"])
    return {
        "rooms": len(rooms),
        "p50_us": C.pct([r["us"] for r in rooms], 50),
        "p99_us": C.pct([r["us"] for r in rooms], 99),
        "wakes_per_room": {k: statistics.mean(r["wakes"].get(k, 0) for r in rooms) for k in kinds},
        "engine_woken_share": len(woken) / len(rooms) if rooms else None,
        "engine_woken_us_p50": C.pct(woken, 50) if woken else None,
        "poller_preempted_share": statistics.mean(r["poller_preempted_us"] > 0 for r in rooms),
        "poller_preempted_us_p50": C.pct([r["poller_preempted_us"] for r in rooms], 50),
        "preempted_by": dict(by.most_common(6)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--tls", default="shm,tcp")
    a = ap.parse_args()
    if not os.access(os.path.join(TRACE, "trace"), os.W_OK):
        sys.exit(f"needs root and tracefs at {TRACE}")
    cases = [dict(R.LAT_POINT, mode="yield"), dict(R.LAT_POINT, mode="spin"),
             dict(R.LAT_POINT_1, mode="yield")]
    out = {"runs": a.runs, "samples": a.samples, "cases": []}
    tmp = tempfile.mkdtemp()
    for tls in a.tls.split(","):
        srv = R.Server("kv_bench.py", C.TRANSPORTS[tls], tmp)
        try:
            for lp in cases:
                rooms, progressed = [], []
                for _ in range(a.runs):
                    with Tracing() as tr:
                        r = srv.request({"cmd": "latency", "point": lp, "samples": a.samples,
                                         "mode": lp["mode"], "windows": True})
                        if "error" in r:
                            raise SystemExit(r["error"])
                        threads = thread_names(r["pids"])
                    rooms += analyse(parse(tr.text), r["windows"], threads, r["pids"][0])
                    progressed.append(r["poll_progressed_per_room"])
                s = summarize(rooms)
                s.update(tls=tls, room=f"{lp['nbuf']} x {lp['item'] // 1024} KiB", mode=lp["mode"],
                         poll_progressed_per_room=statistics.median(progressed))
                out["cases"].append(s)
                print(json.dumps(s), flush=True)
        finally:
            srv.close()
    C.save_result("handoffs.json", out)


if __name__ == "__main__":
    main()
