"""NIXL reference (UCX backend, DRAM -> DRAM) on the same plans as kvrecv.

    UCX_TLS=... python benchmarks/nixl_bench.py --spec SPEC.json --out OUT.json
    python benchmarks/nixl_bench.py --probe          # can an agent start here?

This process is the prefill (the initiator); the decode is a spawned child
(the target).  Per round and room the prefill does what a NIXL-based
connector does: builds the transfer descriptor lists (one descriptor per
contiguous run of pages per KV buffer), initialize_xfer("WRITE", ...,
notif=room) and transfer(); then it polls check_xfer_state.  The decode
polls get_new_notifs() until every room's notification arrived.  Throughput
is bytes / (last notification seen by the decode - t0 before the first
initialize_xfer), both on CLOCK_MONOTONIC, the same definition as kvrecv's
(send() on the prefill to poll()==Success on the decode).  The descriptor
arrays are computed before t0 (a connector would cache most of that), so
the figure favours NIXL slightly.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import common as C  # noqa: E402

ROUND_TIMEOUT = 120.0


def load_nixl():
    """The NIXL Python API module, or raises with what went wrong."""
    errors = []
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            return importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - try the next distribution
            errors.append(f"import {name}: {type(e).__name__}: {e}")
    raise ImportError("; ".join(errors))


def nixl_version(mod) -> str:
    from importlib import metadata

    for dist in ("nixl", "nixl-cu12", "nixl-cu13"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return getattr(mod, "__file__", "?")


PROG_THREAD = os.environ.get("KVBENCH_NIXL_PROG_THREAD", "1") == "1"


def make_agent(nx, name):
    """enable_prog_thread=True is NIXL's default; its progress thread spins
    (a core per agent, also when idle).  KVBENCH_NIXL_PROG_THREAD=0 turns it
    off: transfers then progress inside check_xfer_state/get_new_notifs."""
    return nx.nixl_agent(name, nx.nixl_agent_config(enable_prog_thread=PROG_THREAD,
                                                    backends=["UCX"]))


def descs_for(point, plan, bases):
    """Per room, an (n, 3) uint64 array of (address, length, dev) for the
    source (bases = prefill buffers) or destination side, one row per
    contiguous run per buffer."""
    item = point["item"]
    out = []
    for src, dst in plan:
        runs = C.runs_of(src, dst)
        rows_s, rows_d = [], []
        for b in range(point["nbuf"]):
            for s0, d0, n in runs:
                rows_s.append((bases[0][b] + s0 * item, n * item, 0))
                rows_d.append((bases[1][b] + d0 * item, n * item, 0))
        out.append((np.array(rows_s, dtype=np.uint64), np.array(rows_d, dtype=np.uint64)))
    return out


def decode_main(conn):
    nx = load_nixl()
    agent = make_agent(nx, "decode")
    bufs, plan, point, samples, reg = None, None, None, None, None
    conn.send(("ready", os.getpid()))
    while True:
        try:
            cmd, arg = conn.recv()
        except EOFError:
            return
        try:
            if cmd == "exit":
                conn.send(("ok", None))
                return
            if cmd == "setup":
                point = arg
                if reg is not None:
                    agent.deregister_memory(reg)
                    reg = None
                bufs = None
                gc.collect()
                bufs = C.dest_pool(point)
                plan = C.make_plan(point)
                samples = C.sample_pages(point["nbuf"], plan)
                reg = agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs],
                                            "DRAM")
                conn.send(("ok", {"meta": agent.get_agent_metadata(),
                                  "bases": [b.ctypes.data for b in bufs]}))
            elif cmd == "round":
                tag = arg
                C.clear_samples(bufs, point["item"], plan, samples)
                cpu0 = C.cpu_now()
                conn.send(("ok", None))
                want = {f"{tag}:{r}".encode() for r in range(point["rooms"])}
                got = set()
                deadline = time.monotonic() + ROUND_TIMEOUT
                t1 = None
                while time.monotonic() < deadline:
                    notifs = agent.get_new_notifs()
                    for msgs in notifs.values():
                        got.update(m for m in msgs if m in want)
                    if got == want:
                        t1 = C.now_ns()
                        break
                    time.sleep(0.0002)
                cpu1 = C.cpu_now()
                bad = C.check_pages(bufs, point["item"], plan, samples) if t1 else ["timeout"]
                conn.send(("ok", {"t1": t1, "cpu": cpu1 - cpu0, "bad": bad[:4]}))
            else:
                raise ValueError(cmd)
        except Exception:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))


class Bench:
    def __init__(self):
        self.nx = load_nixl()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=decode_main, args=(child,), daemon=True)
        self.proc.start()
        tag, _ = self.conn.recv()
        assert tag == "ready"
        self.agent = make_agent(self.nx, "prefill")
        self.remote = None
        self.npoint = 0
        self.cur = None  # (point, bufs, registration, rooms) of the last call, for reuse

    def call(self, cmd, arg=None, timeout=ROUND_TIMEOUT * 2):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout):
            raise RuntimeError("decode child did not answer")
        tag, val = self.conn.recv()
        if tag == "error":
            raise RuntimeError("decode child: " + val)
        return val

    def _release(self):
        if self.cur is not None:
            self.agent.deregister_memory(self.cur[2])
            self.cur = None

    def point(self, point, nrounds, warmup=1, reuse=False):
        """nrounds measured rounds (after warmup ones); reuse: on the
        buffers, registration and descriptors of the last call if it was
        this point (run.py takes one round at a time, in turn with
        kvrecv's)."""
        if reuse and self.cur is not None and self.cur[0] == point:
            _p, bufs, reg, rooms = self.cur
        else:
            self._release()
            bufs = [np.empty(C.pool_pages(point) * point["item"], dtype=np.uint8)
                    for _ in range(point["nbuf"])]
            for b, buf in enumerate(bufs):
                C.fill_pattern(buf, b)
            reg = self.agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs],
                                             "DRAM")
            info = self.call("setup", point)
            if self.remote is not None:
                self.agent.remove_remote_agent(self.remote)
            self.remote = self.agent.add_remote_agent(info["meta"])
            plan = C.make_plan(point)
            rooms = descs_for(point, plan, ([b.ctypes.data for b in bufs], info["bases"]))
            self.cur = (point, bufs, reg, rooms)
        out = {"point": point, "name": C.point_name(point),
               "descs_per_room": int(np.median([len(s) for s, _ in rooms])), "rounds": []}
        for i in range(warmup + nrounds):
            tag = f"{self.npoint}.{i}"
            self.call("round", tag)
            cpu0 = C.cpu_now()
            t0 = C.now_ns()
            handles = []
            for r, (s, d) in enumerate(rooms):
                ls = self.agent.get_xfer_descs(s, "DRAM")
                rd = self.agent.get_xfer_descs(d, "DRAM")
                h = self.agent.initialize_xfer("WRITE", ls, rd, self.remote, f"{tag}:{r}".encode())
                st = self.agent.transfer(h)
                if st == "ERR":
                    raise RuntimeError(f"transfer() returned ERR for room {r}")
                handles.append(h)
            t_posted = C.now_ns()
            pending = list(handles)
            while pending:
                nxt = []
                for h in pending:
                    st = self.agent.check_xfer_state(h)
                    if st == "ERR":
                        raise RuntimeError("check_xfer_state() returned ERR")
                    if st != "DONE":
                        nxt.append(h)
                pending = nxt
                if pending:
                    time.sleep(0.0002)
            t_local = C.now_ns()
            cpu1 = C.cpu_now()
            for h in handles:
                self.agent.release_xfer_handle(h)
            dec = self._round_result()
            if dec["t1"] is None:
                out["error"] = f"round {i}: notifications missing after {ROUND_TIMEOUT} s"
                break
            t1 = max(dec["t1"], t_local)
            rec = {"seconds": (t1 - t0) / 1e9, "post_seconds": (t_posted - t0) / 1e9,
                   "initiator_done_seconds": (t_local - t0) / 1e9,
                   "gbps": C.round_bytes(point) / ((t1 - t0) / 1e9) / 1e9,
                   "prefill_cpu": cpu1 - cpu0, "decode_cpu": dec["cpu"], "bad": dec["bad"]}
            (out["rounds"] if i >= warmup else out.setdefault("warmup", [])).append(rec)
        self.npoint += 1
        return C.summarize_nixl_rounds(out, point)

    def _round_result(self):
        if not self.conn.poll(ROUND_TIMEOUT * 2):
            raise RuntimeError("decode child did not answer")
        tag, val = self.conn.recv()
        if tag == "error":
            raise RuntimeError("decode child: " + val)
        return val

    def close(self):
        try:
            self.call("exit", timeout=30)
        except Exception:  # noqa: BLE001
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def probe():
    """Starts one agent with the UCX backend under the current UCX_TLS."""
    res = {"UCX_TLS": os.environ.get("UCX_TLS")}
    try:
        nx = load_nixl()
        res["version"] = nixl_version(nx)
        a = make_agent(nx, "probe")
        res["ok"] = "UCX" in a.backends
        if not res["ok"]:
            res["error"] = "the UCX backend was not created (plugin missing)"
    except Exception as e:  # noqa: BLE001
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(res))


def serve():
    """Long-lived mode for run.py."""
    b = Bench()
    C.serve_points(b, lambda: {"version": nixl_version(b.nx), "prog_thread": PROG_THREAD})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec")
    ap.add_argument("--out")
    ap.add_argument("--probe", action="store_true")
    ap.add_argument("--serve", action="store_true")
    a = ap.parse_args()
    if a.probe:
        probe()
        return
    if a.serve:
        serve()
        return
    with open(a.spec) as f:
        spec = json.load(f)
    res = {"UCX_TLS": os.environ.get("UCX_TLS"), "points": [], "errors": [],
           "prog_thread": PROG_THREAD}
    b = None
    try:
        b = Bench()
        res["version"] = nixl_version(b.nx)
        for p in spec["points"]:
            t = time.monotonic()
            try:
                r = b.point(p, spec["rounds"], spec.get("warmup", 1))
            except Exception:  # noqa: BLE001
                r = {"point": p, "name": C.point_name(p), "error": traceback.format_exc()}
            r["wall_s"] = time.monotonic() - t
            res["points"].append(r)
            print(f"  nixl   {res['UCX_TLS']:<20} {r['name']:<32} "
                  f"{r.get('gbps', float('nan')):7.3f} GB/s  descs/room {r.get('descs_per_room')}"
                  f"  ({r['wall_s']:.1f} s){'  ERROR' if 'error' in r else ''}", flush=True)
            C.dump(a.out, res)
    except Exception:  # noqa: BLE001
        res["errors"].append(traceback.format_exc())
        print(traceback.format_exc(), file=sys.stderr)
    finally:
        if b is not None:
            b.close()
        C.dump(a.out, res)


if __name__ == "__main__":
    main()
