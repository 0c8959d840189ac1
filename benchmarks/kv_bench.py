"""kvrecv measurements for one transport: throughput, latency, poll() cost
and scale.  Run by run.py as

    UCX_TLS=... python benchmarks/kv_bench.py --spec SPEC.json --out OUT.json

This process is the decode instance (and hosts the bootstrap server); the
prefill instance is a child process started with multiprocessing "spawn",
which inherits UCX_TLS from the environment.  The two talk over a pipe that
carries commands and timestamps only; KV bytes move through kvrecv.

Cross-process times use CLOCK_MONOTONIC (time.monotonic_ns), which on Linux
is one clock for all processes: the prefill takes t0 right before
KVSender.send(), the decode takes t1 when poll() first returns Success.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import common as C  # noqa: E402

POLL_SLEEP = 0.0002
ROUND_TIMEOUT = 120.0


# --------------------------------------------------------------------------
# The prefill child
# --------------------------------------------------------------------------


def _wait_states(rooms, ok_states, timeout):
    deadline = time.monotonic() + timeout
    pending = list(rooms)
    while pending:
        pending = [r for r in pending if r.poll() not in ok_states]
        if not pending:
            break
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SLEEP)
    return True


def prefill_main(conn, config):
    from kvrecv import KVArgs, KVConfig, KVManager, KVPoll, KVSender

    terminal = (KVPoll.Success, KVPoll.Failed)
    ready = (KVPoll.WaitingForInput,) + terminal
    mgr = None
    bufs = None
    plan = None
    point = None
    senders = {}
    lat_prev = None
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "exit":
                if mgr is not None:
                    mgr.close()
                conn.send(("ok", None))
                return
            elif cmd == "setup":
                point, cfg, bootstrap = arg
                lat_prev = None
                if mgr is not None:
                    mgr.close()
                    mgr = None
                bufs = None
                gc.collect()
                bufs = [np.empty(C.pool_pages(point) * point["item"], dtype=np.uint8)
                        for _ in range(point["nbuf"])]
                for b, buf in enumerate(bufs):
                    C.fill_pattern(buf, b)
                plan = C.make_plan(point) if point.get("layout") else None
                mgr = KVManager(KVArgs.from_buffers(0, bufs, [point["item"]] * point["nbuf"]),
                                "prefill", bootstrap_addr=bootstrap, config=KVConfig(**cfg))
                conn.send(("ok", {"transport": mgr.transport, "endpoint": mgr.endpoint,
                                  "rss": C.rss_bytes(), "core_build": C.core_build()}))
            elif cmd == "round":
                ids = arg
                ss = []
                for rid, (src, _dst) in zip(ids, plan):
                    s = KVSender(mgr, bootstrap, rid)
                    s.init(len(src))
                    ss.append(s)
                if not _wait_states(ss, ready, ROUND_TIMEOUT):
                    raise RuntimeError("senders never saw the decode requests: "
                                       + str([int(s.poll()) for s in ss][:8]))
                st0 = mgr.stats()
                th0 = C.thread_cpu()
                cpu0 = C.cpu_now()
                t0 = C.now_ns()
                calls = []
                for s, (src, _dst) in zip(ss, plan):
                    ta = time.perf_counter_ns()
                    s.send(src)
                    calls.append(time.perf_counter_ns() - ta)
                t_posted = C.now_ns()
                conn.send(("t0", (t0, t_posted, calls)))
                conn.recv()  # the decode saw every room end
                ok = _wait_states(ss, terminal, 30)
                cpu1 = C.cpu_now()
                th1 = C.thread_cpu()
                st1 = mgr.stats()
                states = [int(s.poll()) for s in ss]
                for s in ss:
                    s.clear()
                conn.send(("ok", {
                    "cpu": cpu1 - cpu0,
                    "threads": {k: th1.get(k, 0) - th0.get(k, 0) for k in th1},
                    "ops": st1["rma_ops_posted"] - st0["rma_ops_posted"],
                    "bytes": st1["bytes_moved"] - st0["bytes_moved"],
                    "states": states, "settled": ok}))
            elif cmd == "lat":
                # the previous sample's sender is cleared here, outside the
                # measured window; after send() this process blocks on the
                # pipe, so it takes no CPU while the decode waits
                rid, page = arg
                if lat_prev is not None:
                    _wait_states([lat_prev], terminal, 30)
                    lat_prev.clear()
                    lat_prev = None
                s = KVSender(mgr, bootstrap, rid)
                s.init(1)
                while s.poll() not in ready:
                    time.sleep(0.00005)
                t0 = C.now_ns()
                s.send(np.array([page], dtype=np.int32))
                conn.send(("t0", t0))
                lat_prev = s
            elif cmd == "open":
                ids = arg
                rss0 = C.rss_bytes()
                heap0 = C.heap_bytes()
                senders = {}
                t_a = time.perf_counter()
                for rid in ids:
                    s = KVSender(mgr, bootstrap, rid)
                    s.init(1)
                    senders[rid] = s
                t_open = time.perf_counter() - t_a
                ok = _wait_states(list(senders.values()), ready, 120)
                rss1 = C.rss_bytes()
                heap1 = C.heap_bytes()
                conn.send(("ok", {"rss0": rss0, "rss1": rss1, "heap0": heap0, "heap1": heap1,
                                  "open_s": t_open, "ready": ok}))
            elif cmd == "go":
                st0 = mgr.stats()
                t0 = C.now_ns()
                for i, s in enumerate(senders.values()):
                    s.send(np.array([i], dtype=np.int32))
                conn.send(("t0", t0))
                conn.recv()
                _wait_states(list(senders.values()), terminal, 60)
                states = [int(s.poll()) for s in senders.values()]
                st1 = mgr.stats()
                rss2 = C.rss_bytes()
                for s in senders.values():
                    s.clear()
                senders = {}
                gc.collect()
                conn.send(("ok", {"states": states, "rss_done": rss2, "rss_cleared": C.rss_bytes(),
                                  "ops": st1["rma_ops_posted"] - st0["rma_ops_posted"],
                                  "failures": {k: v for k, v in st1["failures_by_code"].items() if v}}))
            else:
                raise ValueError(cmd)
        except Exception:  # noqa: BLE001 - report to the parent
            conn.send(("error", traceback.format_exc()))


class Child:
    def __init__(self, config):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, args=(child, config), daemon=True)
        self.proc.start()
        tag, self.pid = self.conn.recv()
        assert tag == "ready"

    def call(self, cmd, arg=None, timeout=ROUND_TIMEOUT * 2):
        self.conn.send((cmd, arg))
        return self.reply(timeout)

    def reply(self, timeout=ROUND_TIMEOUT * 2):
        if not self.conn.poll(timeout):
            raise RuntimeError("prefill child did not answer")
        tag, val = self.conn.recv()
        if tag == "error":
            raise RuntimeError("prefill child: " + val)
        return val

    def close(self):
        try:
            self.call("exit", None, timeout=30)
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


# --------------------------------------------------------------------------
# The decode side (this process)
# --------------------------------------------------------------------------


class Decode:
    """The decode instance.  Every setup() starts a new bootstrap server: on
    earlier builds, re-creating the prefill manager of a rank on the same
    server let a new decode manager resolve the closed one's endpoint (its
    first rooms then failed with BOOTSTRAP after bootstrap_timeout_ms), see
    README.md and repro_stale_bootstrap.py."""

    def __init__(self, config):
        self.server = None
        self.addr = None
        self.config = config
        self.child = Child(config)
        self.mgr = None
        self.bufs = None
        self.point = None
        self.info = None  # what the child said at the last setup
        self.next_room = 1000

    def setup(self, point, config=None):
        from kvrecv import BootstrapServer, KVArgs, KVConfig, KVManager

        cfg = config or self.config
        if self.mgr is not None:
            self.mgr.close()
            self.mgr = None
        if self.server is not None:
            self.server.close()
        self.server = BootstrapServer(port=0)
        self.addr = self.server.address
        self.bufs = None
        gc.collect()
        self.point = point
        self.bufs = C.dest_pool(point)
        self.plan = C.make_plan(point) if point.get("layout") else None
        self.mgr = KVManager(KVArgs.from_buffers(0, self.bufs, [point["item"]] * point["nbuf"]),
                             "decode", config=KVConfig(**cfg))
        self.info = self.child.call("setup", (point, cfg, self.addr))
        return self.info

    def rooms(self, n):
        ids = list(range(self.next_room, self.next_room + n))
        self.next_room += n
        return ids

    def open_receivers(self, ids, dsts, timeout=ROUND_TIMEOUT):
        from kvrecv import KVPoll, KVReceiver

        rs = []
        for rid in ids:
            r = KVReceiver(self.mgr, self.addr, rid)
            r.init()
            rs.append(r)
        if not _wait_states(rs, (KVPoll.WaitingForInput, KVPoll.Failed), timeout):
            raise RuntimeError("receivers stuck in Bootstrapping")
        for r, dst in zip(rs, dsts):
            r.send_metadata(dst)
        return rs

    # ---- throughput -----------------------------------------------------

    def throughput_point(self, point, nrounds, warmup=1, reuse=False):
        """nrounds measured rounds of the point (after warmup ones); reuse:
        on the buffers and managers of the last call if it was this point
        (run.py takes one round at a time, in turn with NIXL's)."""
        from kvrecv import KVPoll

        terminal = (KVPoll.Success, KVPoll.Failed)
        if reuse and self.mgr is not None and self.point == point and self.info is not None:
            info = self.info
        else:
            info = self.setup(point)
        out = {"point": point, "name": C.point_name(point), "round_bytes": C.round_bytes(point),
               "transport": info["transport"], "prefill_core_build": info.get("core_build"),
               "runs_per_room": [len(C.runs_of(s, d)) for s, d in self.plan][:4],
               "rounds": []}
        samples = C.sample_pages(point["nbuf"], self.plan)
        bad_rounds = []
        for i in range(warmup + nrounds):
            C.clear_samples(self.bufs, point["item"], self.plan, samples)
            ids = self.rooms(point["rooms"])
            rs = self.open_receivers(ids, [d for _s, d in self.plan])
            st0 = self.mgr.stats()
            th0 = C.thread_cpu()
            cpu0 = C.cpu_now()
            self.child.conn.send(("round", ids))
            pending = list(rs)
            deadline = time.monotonic() + ROUND_TIMEOUT
            t1 = None
            while pending and time.monotonic() < deadline:
                pending = [r for r in pending if r.poll() not in terminal]
                if not pending:
                    t1 = C.now_ns()
                    break
                time.sleep(POLL_SLEEP)
            cpu1 = C.cpu_now()
            th1 = C.thread_cpu()
            st1 = self.mgr.stats()
            t0, t_posted, calls = self.child.reply()
            self.child.conn.send(("done", None))
            pre = self.child.reply()
            states = [int(r.poll()) for r in rs]
            bad = C.check_pages(self.bufs, point["item"], self.plan, samples)
            if bad:
                bad_rounds.append({"round": i, "states": states, "mismatches": len(bad),
                                   "first": bad[:4]})
            out["verify"] = "ok" if not bad_rounds else bad_rounds
            reasons = [_reason(r) for r in rs if r.poll() == KVPoll.Failed][:3]
            for r in rs:
                r.clear()
            if t1 is None:
                out["error"] = f"round {i} did not finish in {ROUND_TIMEOUT} s"
                break
            nfail = sum(1 for s in states if s != int(KVPoll.Success))
            rec = {"seconds": (t1 - t0) / 1e9, "post_seconds": (t_posted - t0) / 1e9,
                   "gbps": C.round_bytes(point) / ((t1 - t0) / 1e9) / 1e9,
                   "decode_cpu": cpu1 - cpu0, "prefill_cpu": pre["cpu"],
                   "decode_threads": {k: th1.get(k, 0) - th0.get(k, 0) for k in th1},
                   "prefill_threads": pre["threads"],
                   "ops_per_room": pre["ops"] / point["rooms"],
                   "send_call_us": [c / 1e3 for c in calls],
                   "decode_bytes": st1["bytes_moved"] - st0["bytes_moved"],
                   "decode_cma_bytes": st1["cma_bytes"] - st0["cma_bytes"],
                   "failed_rooms": nfail}
            if nfail:
                rec["failures"] = {k: v for k, v in st1["failures_by_code"].items() if v}
                rec["failure_reasons"] = reasons
            if i >= warmup:
                out["rounds"].append(rec)
            else:
                out.setdefault("warmup", []).append(rec)
        return C.summarize_kv_rounds(out, point)

    # ---- latency --------------------------------------------------------

    def latency(self, point, samples, mode="spin", windows=False):
        """One-page rooms, one at a time.  mode is how the decode polls
        while it waits: "spin" (poll() back to back), "yield" (poll() then
        os.sched_yield()) or "sleep" (poll() then time.sleep(50e-6), as a
        scheduler loop with other work would; with Linux's default 50 us
        timer slack that sleep lasts about 105 us, and time.sleep(0) about
        55 us, which is why "yield" does not use it)."""
        from kvrecv import KVPoll, KVReceiver

        self.setup(point)
        lat = []
        spans = []  # (t0, t1) of each measured room, with windows=True
        fails = []
        pool = C.pool_pages(point)
        progressed0 = self.mgr.stats()["poll_progressed"]
        for i in range(samples + 10):
            rid = self.rooms(1)[0]
            r = KVReceiver(self.mgr, self.addr, rid)
            r.init()
            _wait_states([r], (KVPoll.WaitingForInput, KVPoll.Failed), 30)
            r.send_metadata(np.array([i % pool], dtype=np.int32))
            self.child.conn.send(("lat", (rid, (i * 7) % pool)))
            deadline = time.monotonic() + 30
            st = r.poll()
            if mode == "spin":
                while st != KVPoll.Success and st != KVPoll.Failed:
                    st = r.poll()
                    if time.monotonic() > deadline:
                        break
            else:
                wait = os.sched_yield if mode == "yield" else (lambda: time.sleep(50e-6))
                while st != KVPoll.Success and st != KVPoll.Failed:
                    wait()
                    st = r.poll()
                    if time.monotonic() > deadline:
                        break
            t1 = C.now_ns()
            t0 = self.child.reply()
            if st != KVPoll.Success:
                fails.append(_reason(r) if st == KVPoll.Failed else f"state {int(st)}")
            elif i >= 10:
                lat.append((t1 - t0) / 1e3)
                spans.append((t0, t1))
            r.clear()
        # UCX events the polling thread handled itself (poll_progress)
        progressed = self.mgr.stats()["poll_progressed"] - progressed0
        return {"point": point, "mode": mode, "samples": len(lat), "failed": len(fails),
                "failures": fails[:3],
                "p50_us": C.pct(lat, 50), "p90_us": C.pct(lat, 90), "p99_us": C.pct(lat, 99),
                "min_us": min(lat) if lat else None, "max_us": max(lat) if lat else None,
                "poll_progressed_per_room": progressed / (samples + 10),
                **({"windows": spans, "pids": [os.getpid(), self.child.pid]} if windows else {}),
                "clock": "CLOCK_MONOTONIC (system-wide); t0 right before KVSender.send() in the "
                         "prefill process, t1 when KVReceiver.poll() first returns Success in "
                         "the decode process"}

    # ---- scale and poll -------------------------------------------------

    def open_many(self, n):
        ids = self.rooms(n)
        dsts = [np.array([i], dtype=np.int32) for i in range(n)]
        gc.collect()
        rss0 = C.rss_bytes()
        heap0 = C.heap_bytes()
        t_a = time.perf_counter()
        rs = self.open_receivers(ids, dsts, timeout=120)
        t_open = time.perf_counter() - t_a
        rss1 = C.rss_bytes()
        heap1 = C.heap_bytes()
        pre = self.child.call("open", ids)
        return rs, {"decode_rss0": rss0, "decode_rss1": rss1, "decode_open_s": t_open,
                    "decode_heap0": heap0, "decode_heap1": heap1,
                    "prefill_heap0": pre["heap0"], "prefill_heap1": pre["heap1"],
                    "prefill_rss0": pre["rss0"], "prefill_rss1": pre["rss1"],
                    "prefill_open_s": pre["open_s"], "prefill_ready": pre["ready"]}

    def finish_many(self, rs, timeout=120):
        from kvrecv import KVPoll

        terminal = (KVPoll.Success, KVPoll.Failed)
        self.child.conn.send(("go", None))
        pending = list(rs)
        deadline = time.monotonic() + timeout
        t1 = None
        while pending and time.monotonic() < deadline:
            pending = [r for r in pending if r.poll() not in terminal]
            if not pending:
                t1 = C.now_ns()
                break
            time.sleep(0.001)  # a scheduler iteration's cadence
        t0 = self.child.reply()
        states = [int(r.poll()) for r in rs]
        rss_done = C.rss_bytes()
        self.child.conn.send(("done", None))
        pre = self.child.reply()
        st = self.mgr.stats()
        for r in rs:
            r.clear()
        del rs
        gc.collect()
        return {"seconds": (t1 - t0) / 1e9 if t1 else None,
                "decode_failed": sum(1 for s in states if s == int(KVPoll.Failed)),
                "decode_unfinished": sum(1 for s in states if s not in (0, 4)),
                "prefill_failed": sum(1 for s in pre["states"] if s == int(KVPoll.Failed)),
                "decode_failures": {k: v for k, v in st["failures_by_code"].items() if v},
                "prefill_failures": pre["failures"],
                "decode_rss_done": rss_done, "decode_rss_cleared": C.rss_bytes(),
                "prefill_rss_done": pre["rss_done"], "prefill_rss_cleared": pre["rss_cleared"],
                "prefill_ops": pre["ops"]}

    def scale(self, point, counts, config):
        """Per count: open n rooms (decode receivers with their requests
        sent, then prefill senders), move one page each, clear them.  A
        first single room sets up the peer connection, so that the RSS
        per room counts rooms, not the one-time peer set-up (reported as
        peer_setup)."""
        self.setup(point, config)
        rs, w = self.open_many(1)
        w.update(self.finish_many(rs))
        self.peer_setup = {"decode_rss": w["decode_rss1"] - w["decode_rss0"],
                           "prefill_rss": w["prefill_rss1"] - w["prefill_rss0"],
                           "ok": w["decode_failed"] == 0 and w["decode_unfinished"] == 0}
        out = []
        for n in counts:
            gc.collect()
            rs, o = self.open_many(n)
            f = self.finish_many(rs)
            o.update(f)
            o["rooms"] = n
            o["decode_rss_per_room"] = (o["decode_rss1"] - o["decode_rss0"]) / n
            o["prefill_rss_per_room"] = (o["prefill_rss1"] - o["prefill_rss0"]) / n
            o["decode_heap_per_room"] = (o["decode_heap1"] - o["decode_heap0"]) / n
            o["prefill_heap_per_room"] = (o["prefill_heap1"] - o["prefill_heap0"]) / n
            o["rss_per_1000_rooms_kib"] = {
                "decode": o["decode_rss_per_room"] * 1000 / 1024,
                "prefill": o["prefill_rss_per_room"] * 1000 / 1024}
            o["rooms_per_s"] = n / o["seconds"] if o["seconds"] else None
            o["peer_setup"] = self.peer_setup
            out.append(o)
        return out

    def poll_cost(self, point, n, reps):
        """poll() per call and per scheduler iteration over n receivers that
        are waiting for data (decode requests sent, no sender yet)."""
        from kvrecv import _core

        self.setup(point)
        rs, o = self.open_many(n)
        r0 = rs[0]
        calls = 200000
        per_call, per_iter, floor_iter, core_iter, reduce_iter = [], [], [], [], []
        raw_poll = _core.Room.poll
        for _ in range(reps):
            t = time.perf_counter_ns()
            for _i in range(calls):
                r0.poll()
            per_call.append((time.perf_counter_ns() - t) / calls)
            t = time.perf_counter_ns()
            for r in rs:
                r.poll()
            per_iter.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            for r in rs:
                raw_poll(r)
            core_iter.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            for r in rs:
                id(r)
            floor_iter.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            states = [r.poll() for r in rs]
            min(states)
            reduce_iter.append(time.perf_counter_ns() - t)
        f = self.finish_many(rs)
        return {"receivers": n, "reps": reps,
                "per_call_ns": C.median(per_call),
                "per_iteration_us": C.median(per_iter) / 1e3,
                "per_receiver_ns": C.median(per_iter) / n,
                "per_receiver_ns_core_method": C.median(core_iter) / n,
                "per_receiver_ns_loop_floor": C.median(floor_iter) / n,
                "per_iteration_us_list_and_min": C.median(reduce_iter) / 1e3,
                "all_runs_per_call_ns": per_call,
                "finished_ok": f["decode_failed"] == 0 and f["decode_unfinished"] == 0}

    def close(self):
        self.child.close()
        if self.mgr is not None:
            self.mgr.close()
        if self.server is not None:
            self.server.close()


def _reason(room):
    try:
        room.failure_exception()
    except Exception as e:  # noqa: BLE001 - any failure, reported as text
        return f"{type(e).__name__}[{getattr(e, 'code', '?')}]: {e}"
    return "no exception"


def serve():
    """Long-lived mode for run.py: one JSON request per stdin line, one
    "@@RESULT <json>" line per answer on stdout (UCX logs to stdout too)."""
    d = Decode(C.ROBUST_CONFIG)
    build = C.core_build()
    try:
        for line in sys.stdin:
            req = json.loads(line)
            cmd = req["cmd"]
            t = time.monotonic()
            try:
                if cmd == "exit":
                    break
                if cmd == "throughput":
                    r = d.throughput_point(req["point"], req["rounds"], req.get("warmup", 1),
                                           req.get("reuse", False))
                elif cmd == "latency":
                    r = d.latency(req["point"], req["samples"], req.get("mode", "spin"),
                                  req.get("windows", False))
                elif cmd == "poll":
                    r = d.poll_cost(req["point"], req["receivers"], req["reps"])
                else:
                    raise ValueError(cmd)
            except Exception:  # noqa: BLE001 - answer with the error
                r = {"error": traceback.format_exc()}
            r["wall_s"] = time.monotonic() - t
            r["core_build"] = build
            print("@@RESULT " + json.dumps(r, default=C._json_default), flush=True)
    finally:
        d.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec")
    ap.add_argument("--out")
    ap.add_argument("--serve", action="store_true")
    a = ap.parse_args()
    if a.serve:
        serve()
        return
    with open(a.spec) as f:
        spec = json.load(f)
    res = {"UCX_TLS": os.environ.get("UCX_TLS"), "errors": [], "core_build": C.core_build()}

    def save():
        C.dump(a.out, res)

    d = Decode(spec.get("config", C.ROBUST_CONFIG))
    try:
        if spec.get("throughput"):
            res["throughput"] = []
            for p in spec["throughput"]:
                t = time.monotonic()
                try:
                    r = d.throughput_point(p, spec["rounds"], spec.get("warmup", 1))
                except Exception:  # noqa: BLE001
                    r = {"point": p, "name": C.point_name(p), "error": traceback.format_exc()}
                r["wall_s"] = time.monotonic() - t
                res["throughput"].append(r)
                print(f"  kvrecv {res['UCX_TLS']:<20} {r['name']:<32} "
                      f"{r.get('gbps', float('nan')):7.3f} GB/s  ops/room {r.get('ops_per_room')}"
                      f"  ({r['wall_s']:.1f} s){'  ERROR' if 'error' in r else ''}", flush=True)
                save()
        if spec.get("latency"):
            res["latency"] = []
            for p in spec["latency"]:
                try:
                    r = d.latency(p, spec["latency_samples"], p.get("mode", "spin"))
                except Exception:  # noqa: BLE001
                    r = {"point": p, "error": traceback.format_exc()}
                res["latency"].append(r)
                print(f"  kvrecv {res['UCX_TLS']:<20} latency {p['nbuf']}x{p['item']}B "
                      f"{p.get('mode', 'spin')}: "
                      f"p50 {r.get('p50_us', float('nan')):.1f} us p99 "
                      f"{r.get('p99_us', float('nan')):.1f} us", flush=True)
                save()
        if spec.get("poll"):
            try:
                res["poll"] = d.poll_cost(spec["poll"]["point"], spec["poll"]["receivers"],
                                          spec["poll"]["reps"])
                print(f"  kvrecv {res['UCX_TLS']:<20} poll: {res['poll']['per_call_ns']:.0f} ns/call,"
                      f" {res['poll']['per_receiver_ns']:.0f} ns/receiver over "
                      f"{res['poll']['receivers']}", flush=True)
            except Exception:  # noqa: BLE001
                res["poll"] = {"error": traceback.format_exc()}
            save()
        if spec.get("scale"):
            res["scale"] = {}
            for label, cfg in spec["scale"]["configs"].items():
                try:
                    res["scale"][label] = d.scale(spec["scale"]["point"], spec["scale"]["counts"], cfg)
                except Exception:  # noqa: BLE001
                    res["scale"][label] = {"error": traceback.format_exc()}
                for o in res["scale"][label] if isinstance(res["scale"][label], list) else []:
                    print(f"  kvrecv {res['UCX_TLS']:<20} scale[{label}] {o['rooms']:>5} rooms: "
                          f"{o['seconds'] or float('nan'):.3f} s, failed {o['decode_failed']}"
                          f"/{o['prefill_failed']}, RSS/1000 rooms decode "
                          f"{o['rss_per_1000_rooms_kib']['decode']:.0f} KiB prefill "
                          f"{o['rss_per_1000_rooms_kib']['prefill']:.0f} KiB", flush=True)
                save()
    except Exception:  # noqa: BLE001
        res["errors"].append(traceback.format_exc())
        print(traceback.format_exc(), file=sys.stderr)
    finally:
        save()
        d.close()
    save()


if __name__ == "__main__":
    main()
