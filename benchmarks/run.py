"""The kvrecv benchmark suite.

    python benchmarks/run.py [--quick] [--only tcp|shm] [--skip nixl,cref,perftest,...]
                             [--repeat N]

For UCX_TLS=tcp and for shared memory (UCX_TLS=posix,sysv,cma,self):

  throughput  kvrecv between a prefill and a decode process, contiguous and
              random pages: GB/s, data operations per room, CPU s per GB
  latency     one-page rooms, prefill send() -> decode poll()==Success
  poll        poll() per call and per sweep over 4096 receivers
  scale       1, 64, 1024, 8192 rooms in flight; RSS per 1000 rooms
  references  ucx_perftest (tag_bw at each point's message size; over tcp
              at 16 MiB also tag_bw -e, with the peer-failure handling
              kvrecv's endpoints have; ucp_am_bw, ucp_put_bw), NIXL (UCX backend, DRAM->DRAM), a plain C
              ucp_put_nbx / ucp_get_nbx loop (ref_ucx_put.c) on the same
              plans, and memcpy of the same bytes

Writes benchmarks/results/results.json, throughput.png and summary.md, and
prints the summary table.  Each figure is a median of >= 5 rounds.  For a
throughput point, kvrecv and NIXL take turns round by round (one round of
kvrecv, one of NIXL, and again), so that their ratio compares rounds a
fraction of a second apart on this shared machine; the other references of
the point are measured right after; "best" ratios (best round against best
round) are given beside the median ratios, and the kv/NIXL ratio of each
pair of rounds as median and spread.  --repeat N runs the whole suite N
times and reports, per point, each run's median kv/NIXL round ratio and
the worst of them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import common as C  # noqa: E402
from common import NIXL_SHM_TLS  # noqa: E402
from report import (core_builds, dig, evaluate, fmt, latency_runs, plot,  # noqa: E402,F401
                    repeat_record, summary_md)

RESULTS = os.path.join(HERE, "results")
BUILD = os.path.join(HERE, "build")
KiB, MiB = C.KiB, C.MiB



# --------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------


def throughput_points(quick: bool):
    """64 KV buffers (32 layers x K/V), 64 MiB rooms, 2 rooms per round
    (128 MiB) across page sizes 4, 16 and 64 KiB; rooms of 128 buffers x 16
    pages of 4 KiB (random pages: the most data operations per byte); and a
    long room of 32 buffers x 4096 pages of 4 KiB, whose contiguous runs are
    16 MiB messages (the tcp target's size)."""
    pts = []
    items = [16 * KiB] if quick else [4 * KiB, 16 * KiB, 64 * KiB]
    for item in items:
        pages = 64 * MiB // (64 * item)
        for layout in ("contig", "random"):
            pts.append({"layout": layout, "nbuf": 64, "item": item, "pages": pages, "rooms": 2,
                        "sweep": True})
    if not quick:
        pts.append({"layout": "random", "nbuf": 128, "item": 4 * KiB, "pages": 16, "rooms": 16})
    for layout in ("contig",) if quick else ("contig", "random"):
        pts.append({"layout": layout, "nbuf": 32, "item": 4 * KiB, "pages": 4096, "rooms": 1})
    return pts


def msg_size(p):
    """Bytes per data operation: one run per buffer per room (contiguous),
    one page of one buffer (random)."""
    return p["pages"] * p["item"] if p["layout"] == "contig" else p["item"]


LAT_POINT = {"nbuf": 64, "item": 4 * KiB, "pages": 1, "rooms": 64, "layout": None}
LAT_POINT_1 = {"nbuf": 1, "item": 4 * KiB, "pages": 1, "rooms": 64, "layout": None}
POLL_POINT = {"nbuf": 8, "item": 1 * KiB, "pages": 1, "rooms": 4096, "layout": None}
SCALE_POINT = {"nbuf": 32, "item": 1 * KiB, "pages": 1, "rooms": 8192, "layout": None}
SCALE_COUNTS = [1, 64, 1024, 8192]


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


def log(msg):
    print(msg, flush=True)


def env_for(tls, extra=None):
    env = dict(os.environ)
    env["UCX_TLS"] = tls
    env["PYTHONPATH"] = C.ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # numpy's OpenBLAS starts spinning worker threads; none is needed here
    env["OPENBLAS_NUM_THREADS"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def _useful_tail(text, n=3000):
    lines = [ln for ln in (text or "").splitlines() if "NIXL INFO" not in ln]
    return "\n".join(lines)[-n:]


class Server:
    """A long-lived kv_bench.py / nixl_bench.py --serve process."""

    def __init__(self, script, tls, tmp, extra_env=None):
        self.name = f"{script} UCX_TLS={tls}"
        self.err_path = os.path.join(tmp, f"{script}.{tls}.{time.monotonic_ns()}.stderr")
        self.err = open(self.err_path, "w")
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, script), "--serve"],
                                  env=env_for(tls, extra_env), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.err, text=True, bufsize=1)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self):
        for line in self.p.stdout:
            if line.startswith("@@RESULT "):
                self.q.put(json.loads(line[len("@@RESULT "):]))
        self.q.put(None)

    def request(self, req, timeout=900):
        try:
            self.p.stdin.write(json.dumps(req) + "\n")
            self.p.stdin.flush()
            r = self.q.get(timeout=timeout)
        except (BrokenPipeError, queue.Empty) as e:
            r = None
            why = type(e).__name__
        else:
            why = "process ended"
        if r is None:
            self.err.flush()
            with open(self.err_path) as f:
                tail = _useful_tail(f.read(), 2000)
            return {"error": f"{self.name}: no answer ({why}); stderr: {tail}"}
        return r

    def close(self):
        try:
            self.p.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.p.wait(30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.err.close()


def run_json_script(script, spec, tls, timeout, tmp, tag):
    spec_path = os.path.join(tmp, f"{tag}.spec.json")
    out_path = os.path.join(tmp, f"{tag}.out.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    try:
        p = subprocess.run([sys.executable, os.path.join(HERE, script), "--spec", spec_path,
                            "--out", out_path], env=env_for(tls), timeout=timeout,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for line in p.stdout.splitlines():
            if not line.startswith("["):
                log(line)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", e.stderr.decode(errors="replace") if isinstance(
            e.stderr, bytes) else (e.stderr or "")
    res = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            res = json.load(f)
    res["_rc"] = rc
    if rc != 0:
        res["_stderr_tail"] = _useful_tail(err)
    return res


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def cmd_out(args):
    if not shutil.which(args[0]):
        return f"({args[0]} not installed)"
    try:
        return subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"({type(e).__name__}: {e})"


def machine_info():
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    sys.path.insert(0, C.ROOT)
    import kvrecv

    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "ucx": cmd_out(["ucx_info", "-v"]).splitlines()[0:1],
        "kvrecv_commit": cmd_out(["git", "-C", C.ROOT, "rev-parse", "HEAD"]),
        "kvrecv_tree_dirty": bool(cmd_out(["git", "-C", C.ROOT, "status", "--porcelain",
                                           "--untracked-files=no"])),
        "kvrecv_module": kvrecv.__file__,
        "loadavg_start": os.getloadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


# --------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------


def perftest(tls, test, size, reps, total_bytes=64 * MiB, err=False):
    """ucx_perftest server + client on 127.0.0.1; GB/s of the client's
    "overall" bandwidth (ucx_perftest prints MiB/s).  err: endpoints with
    peer-failure handling (-e), as kvrecv's and NIXL's are: over tcp UCX 1.13
    then selects no RMA lane, so a rendezvous moves its data as active
    messages that the receiver copies out of its socket buffer."""
    flags = ["-e"] if err else []
    iters = int(min(200000, max(8 if size >= 16 * MiB else 32, total_bytes // size)))
    warm = max(4, iters // 10)
    runs, errors = [], []
    for _ in range(reps):
        for _attempt in range(3):
            port = free_port()
            env = env_for(tls)
            srv = subprocess.Popen(["ucx_perftest", "-p", str(port)] + flags, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.25)
            try:
                cli = subprocess.run(["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test,
                                      "-s", str(size), "-n", str(iters), "-w", str(warm)] + flags,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, timeout=120)
                out = cli.stdout
            except subprocess.TimeoutExpired:
                out = "timeout"
            try:
                srv.wait(10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()
            m = [ln for ln in out.splitlines() if ln.startswith("Final:")]
            if m:
                f = m[-1].split()
                # Final: iters lat50 lat_avg lat_overall bw_avg bw_overall(MiB/s) ...
                runs.append(float(f[6]) * MiB / 1e9)
                break
            errors.append(out[-500:])
    e = " -e" if err else ""
    return {"test": test + e, "size": size, "iters": iters, "UCX_TLS": tls,
            "gbps": C.median(runs) if runs else None, "gbps_all": runs,
            "errors": errors[:2] if not runs else [],
            "command": f"UCX_TLS={tls} ucx_perftest -p PORT{e} & UCX_TLS={tls} ucx_perftest "
                       f"127.0.0.1 -p PORT -t {test} -s {size} -n {iters} -w {warm}{e}"}


def perftest_lat(tls, test, size, reps, iters=2000):
    """ucx_perftest latency (half round trip, both sides busy-polling):
    the median of the runs' 50th percentiles, in us."""
    runs, errors = [], []
    for _ in range(reps):
        for _attempt in range(3):
            port = free_port()
            env = env_for(tls)
            srv = subprocess.Popen(["ucx_perftest", "-p", str(port)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.25)
            try:
                out = subprocess.run(["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test,
                                      "-s", str(size), "-n", str(iters), "-w", "200"], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     timeout=120).stdout
            except subprocess.TimeoutExpired:
                out = "timeout"
            try:
                srv.wait(10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait()
            m = [ln for ln in out.splitlines() if ln.startswith("Final:")]
            if m:
                runs.append(float(m[-1].split()[2]))
                break
            errors.append(out[-500:])
    return {"test": test, "size": size, "UCX_TLS": tls, "p50_us": C.median(runs) if runs else None,
            "p50_us_all": runs, "errors": errors[:2] if not runs else []}


def build_c(name, flags=()):
    """benchmarks/NAME.c built into benchmarks/build/NAME: (path, command)."""
    os.makedirs(BUILD, exist_ok=True)
    exe = os.path.join(BUILD, name)
    cmd = ["gcc", "-O2", "-Wall", "-o", exe, os.path.join(HERE, name + ".c")] + list(flags)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"building {name} failed: " + " ".join(cmd) + "\n" + p.stdout)
    return exe, " ".join(cmd)


def build_c_ref():
    return build_c("ref_ucx_put", cmd_out(["pkg-config", "--cflags", "--libs", "ucx"]).split())


def c_ref(exe, tls, point, mode, rounds, tmp):
    plan_path = os.path.join(tmp, C.point_name(point) + ".plan")
    if not os.path.exists(plan_path):
        C.write_plan_file(plan_path, point, C.make_plan(point))
    try:
        p = subprocess.run([exe, plan_path, mode, str(rounds), "1"], env=env_for(tls),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not line:
            return {"error": f"rc {p.returncode}: {_useful_tail(p.stderr, 800)}"}
        r = json.loads(line[-1])
    except subprocess.TimeoutExpired:
        return {"error": "timeout"}
    gb = C.round_bytes(point) / 1e9
    r["gbps_all"] = [gb / s for s in r["seconds"]]
    r["gbps"] = C.median(r["gbps_all"])
    n = len(r["seconds"])
    r["cpu_s_per_gb"] = {"initiator": r["initiator_cpu"] / (gb * n),
                         "passive": r["passive_cpu"] / (gb * (n + 1)),
                         "total": r["initiator_cpu"] / (gb * n) + r["passive_cpu"] / (gb * (n + 1))}
    r["verify"] = "ok" if r.get("bad_pages") == 0 else f"{r.get('bad_pages')} bad pages"
    return r


def memcpy_ref(point, reps):
    """One process, one thread, the round's bytes per buffer: np.copyto of
    the whole buffer (memcpy), and numpy page copies with the plan's pages
    (slices for contiguous runs, fancy indexing for random pages)."""
    pool = C.pool_pages(point)
    item = point["item"]
    nb = min(point["nbuf"], 8)  # the same bytes per buffer; fewer buffers
    src = [np.empty(pool * item, dtype=np.uint8) for _ in range(nb)]
    dst = [np.zeros(pool * item, dtype=np.uint8) for _ in range(nb)]
    for b in range(nb):
        C.fill_pattern(src[b], b)
    plan = C.make_plan(point)
    nbytes = pool * item * nb
    block, pages = [], []
    for _ in range(reps + 1):
        t = time.perf_counter()
        for b in range(nb):
            np.copyto(dst[b], src[b])
        block.append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        for b in range(nb):
            sv = src[b].reshape(pool, item)
            dv = dst[b].reshape(pool, item)
            if point["layout"] == "contig":
                for s, d in plan:
                    dv[d[0]:d[0] + len(d)] = sv[s[0]:s[0] + len(s)]
            else:
                for s, d in plan:
                    dv[d] = sv[s]
        pages.append(nbytes / (time.perf_counter() - t) / 1e9)
    return {"memcpy_gbps": C.median(block[1:]), "numpy_pages_gbps": C.median(pages[1:]),
            "memcpy_gbps_all": block[1:], "buffers_used": nb}

def nixl_probe(res):
    res["nixl_probe"] = {}
    for label, tls in (("shm", C.TRANSPORTS["shm"]), ("tcp", "tcp"), ("shm+tcp", NIXL_SHM_TLS)):
        p = subprocess.run([sys.executable, os.path.join(HERE, "nixl_bench.py"), "--probe"],
                           env=env_for(tls), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=120)
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        pr = json.loads(line[-1]) if line else {"ok": False, "error": f"no output (rc {p.returncode})"}
        pr["returncode"] = p.returncode
        if p.returncode < 0:
            pr["note"] = f"the process died of signal {-p.returncode} at exit (NIXL agent teardown)"
        if not pr.get("ok"):
            # UCX logs to stdout, NIXL (glog) to stderr
            pr["log"] = [ln.strip() for ln in (p.stdout + p.stderr).splitlines()
                         if not ln.startswith("{") and "NIXL INFO" not in ln
                         and ("ERROR" in ln or "error" in ln or ln.startswith(("E", "W")))][:8]
        res["nixl_probe"][label] = pr
        if pr.get("version"):
            res["nixl_version"] = pr["version"]
        log(f"NIXL probe UCX_TLS={tls}: {'ok' if pr.get('ok') else pr.get('error')}")


def run_transport(label, res, a, points, skip, exe, tmp, reps_pt):
    tls = C.TRANSPORTS[label]
    tr = res["transports"].setdefault(label, {"UCX_TLS": tls, "points": []})
    log(f"== {label}: UCX_TLS={tls}")
    nixl_ok = "nixl" not in skip and res.get("nixl_probe", {}).get("tcp", {}).get("ok")
    ntls = tls if label == "tcp" else NIXL_SHM_TLS
    kv = Server("kv_bench.py", tls, tmp) if "kvrecv" not in skip else None
    # Mooncake's Python TransferEngine moves host memory over tcp (or RDMA)
    mc = Server("mooncake_bench.py", tls, tmp) if label == "tcp" and "mooncake" not in skip else None
    nx = Server("nixl_bench.py", ntls, tmp, {"KVBENCH_NIXL_PROG_THREAD": "0"}) if nixl_ok else None
    try:
        for p in points:
            name = C.point_name(p)
            rec = {"name": name, "point": p, "msg_size": msg_size(p)}
            tr["points"].append(rec)
            # kvrecv and NIXL take turns, one round each, so that both see
            # the same minutes of this shared machine (their ratio is the
            # figure); the other references follow.
            turns = [(k, srv, req) for k, srv, req in (
                ("kvrecv", kv, {"cmd": "throughput", "point": p}),
                ("nixl", nx, {"cmd": "point", "point": p}),
                ("mooncake", mc, {"cmd": "point", "point": p})) if srv is not None]
            got = {k: [] for k, _s, _r in turns}
            for i in range(a.rounds):
                for k, srv, req in turns:
                    if got[k] and "error" in got[k][-1]:
                        continue
                    got[k].append(srv.request(dict(req, rounds=1, warmup=1 if i == 0 else 0,
                                                   reuse=i > 0)))
            if kv:
                r = C.merge_rounds(got["kvrecv"], p, C.summarize_kv_rounds)
                rec["kvrecv"] = r
                log(f"  {label} {name:<30} kvrecv {fmt(r.get('gbps'))} GB/s, ops/room "
                    f"{fmt(r.get('ops_per_room'), 0)}, CPU {fmt(dig(r, 'cpu_s_per_gb', 'total'), 2)} s/GB"
                    f"{'' if r.get('verify', 'ok') == 'ok' else ' VERIFY FAILED'}"
                    f"{' ERROR ' + r['error'][-300:] if 'error' in r else ''}")
            if nx:
                r = C.merge_rounds(got["nixl"], p, C.summarize_nixl_rounds)
                r["UCX_TLS"] = ntls
                rec["nixl"] = r
                log(f"  {label} {name:<30} NIXL   {fmt(r.get('gbps'))} GB/s, descs/room "
                    f"{r.get('descs_per_room')}{' ERROR ' + r['error'][-300:] if 'error' in r else ''}")
            if mc:
                r = C.merge_rounds(got["mooncake"], p, C.summarize_nixl_rounds)
                rec["mooncake"] = r
                log(f"  {label} {name:<30} Mooncake {fmt(r.get('gbps'))} GB/s, batch entries/room "
                    f"{r.get('descs_per_room')}{' ERROR ' + r['error'][-300:] if 'error' in r else ''}")
            if exe:
                for mode in ("put", "get"):
                    r = c_ref(exe, tls, p, mode, a.rounds, tmp)
                    rec["c_" + mode] = r
                    log(f"  {label} {name:<30} C {mode}  {fmt(r.get('gbps'))} GB/s"
                        f"{' ' + r['error'] if 'error' in r else ''}"
                        f"{'' if r.get('verify', 'ok') == 'ok' else ' ' + str(r.get('verify'))}")
            if "perftest" not in skip:
                r = perftest(tls, "tag_bw", rec["msg_size"], reps_pt)
                rec["tag_bw"] = r
                log(f"  {label} {name:<30} ucx_perftest tag_bw {rec['msg_size'] // KiB} KiB "
                    f"{fmt(r.get('gbps'))} GB/s")
                if label == "tcp" and rec["msg_size"] == 16 * MiB:
                    r = perftest(tls, "tag_bw", rec["msg_size"], reps_pt, err=True)
                    rec["tag_bw_e"] = r
                    log(f"  {label} {name:<30} ucx_perftest tag_bw -e {rec['msg_size'] // KiB} "
                        f"KiB {fmt(r.get('gbps'))} GB/s")
            C.dump(a.out, res)
        if kv:
            # a.rounds runs of lat_samples rooms per case, the cases
            # interleaved run by run; each figure is the median over runs
            lat = [dict(LAT_POINT, mode=m) for m in ("spin", "yield", "sleep")]
            lat.append(dict(LAT_POINT_1, mode="yield"))
            runs = [[] for _ in lat]
            for rnd in range(a.rounds):
                for lp, rs in zip(lat, runs):
                    r = kv.request({"cmd": "latency", "point": lp, "samples": a.lat_samples,
                                    "mode": lp["mode"]})
                    rs.append(r)
                    log(f"  {label} latency {lp['nbuf']} x {lp['item'] // KiB} KiB, {lp['mode']:<5} "
                        f"poll, run {rnd + 1}: p50 {fmt(r.get('p50_us'), 1)} us, p99 "
                        f"{fmt(r.get('p99_us'), 1)} us"
                        f"{' ERROR ' + r['error'][-300:] if 'error' in r else ''}")
            tr["latency"] = [latency_runs(rs) for rs in runs]
            r = kv.request({"cmd": "poll", "point": POLL_POINT, "receivers": 4096, "reps": 7})
            tr["poll"] = r
            log(f"  {label} poll(): {fmt(r.get('per_call_ns'), 0)} ns per call, "
                f"{fmt(r.get('per_receiver_ns'), 0)} ns per receiver in a sweep of 4096"
                f"{' ERROR ' + r['error'][-300:] if 'error' in r else ''}")
            C.dump(a.out, res)
    finally:
        if kv:
            kv.close()
        if nx:
            nx.close()
        if mc:
            mc.close()
    if nixl_ok and not a.quick:
        # NIXL as configured by default: a progress thread per agent (it
        # spins, a core each); on the random points only.
        nx = Server("nixl_bench.py", ntls, tmp, {"KVBENCH_NIXL_PROG_THREAD": "1"})
        try:
            for rec in tr["points"]:
                if rec["point"]["layout"] == "random":
                    r = nx.request({"cmd": "point", "point": rec["point"], "rounds": a.rounds})
                    rec["nixl_prog_thread"] = r
                    log(f"  {label} {rec['name']:<30} NIXL (progress thread) {fmt(r.get('gbps'))} GB/s")
        finally:
            nx.close()
    if "scale" not in skip:
        tr["scale"] = []
        for n in SCALE_COUNTS:
            # a fresh process pair per count, so RSS growth is not hidden by
            # memory an earlier count freed
            spec = {"scale": {"point": SCALE_POINT, "counts": [n], "configs": {"default": {}}}}
            r = run_json_script("kv_bench.py", spec, tls, 600, tmp, f"scale-{label}-{n}")
            got = dig(r, "scale", "default")
            o = got[0] if isinstance(got, list) and got else {
                "error": got.get("error") if isinstance(got, dict) else r.get("errors"),
                "stderr": r.get("_stderr_tail")}
            o["core_build"] = r.get("core_build")
            tr["scale"].append(o)
        C.dump(a.out, res)
    if "perftest" not in skip:
        tr["perftest_lat"] = []
        for size in (4 * KiB, 64 * 4 * KiB):
            r = perftest_lat(tls, "ucp_am_lat", size, reps_pt)
            tr["perftest_lat"].append(r)
            log(f"  {label} ucx_perftest ucp_am_lat {size // KiB} KiB p50 {fmt(r.get('p50_us'), 1)} us")
        tr["perftest"] = {}
        tests = [("tag_bw", 16 * MiB)] + [(t, s) for t in ("ucp_am_bw", "ucp_put_bw")
                                            for s in (1 * MiB, 16 * MiB)]
        if label == "tcp":
            tests.append(("tag_bw -e", 16 * MiB))
        for test, size in tests:
            r = perftest(tls, test.split()[0], size, reps_pt, err=test.endswith("-e"))
            tr["perftest"][f"{test}:{size}"] = r
            log(f"  {label} ucx_perftest {test} {size // KiB} KiB {fmt(r.get('gbps'))} GB/s")
        C.dump(a.out, res)


def run_suite(a, points, skip, exe, tmp):
    """One whole run of the suite (every transport, the references, memcpy);
    the results dict without the targets."""
    reps_pt = 5
    t_start = time.monotonic()
    res = {"quick": a.quick, "rounds": a.rounds, "machine": machine_info(), "transports": {},
           "definitions": {
               "GB/s": "1e9 bytes/s: KV bytes of a round / time from the prefill's first send() "
                       "to the decode's last poll()==Success (CLOCK_MONOTONIC in both processes)",
               "ops/room": "kvrecv: prefill manager.stats()['rma_ops_posted'] delta / rooms; "
                           "NIXL: descriptors per room; C: ucp_put_nbx/ucp_get_nbx calls per room",
               "CPU s/GB": "getrusage(RUSAGE_SELF) user+sys of each process (all threads) over a "
                           "round / GB moved",
               "msg": "bytes per data operation: pages*item for contiguous rooms, item for random",
               "latency": "one-page room: t0 right before KVSender.send() in the prefill, t1 when "
                          "KVReceiver.poll() first returns Success in the decode; "
                          "time.monotonic_ns() (CLOCK_MONOTONIC, one clock for all processes)",
               "ratio": "kvrecv median / reference median, both of the same point, measured "
                        "back to back; ratio_best: best round / best round",
               "kv/NIXL by round": "kvrecv's round / NIXL's round taken right after it, for "
                                   "each pair; median and spread (report.round_ratios)",
           },
           "grid": {"throughput": points, "latency": [LAT_POINT, LAT_POINT_1],
                    "poll": POLL_POINT, "scale": {"point": SCALE_POINT, "counts": SCALE_COUNTS}}}
    if "nixl" not in skip:
        nixl_probe(res)
    for label in [a.only] if a.only else ["tcp", "shm"]:
        try:
            run_transport(label, res, a, points, skip, exe, tmp, reps_pt)
        except Exception:  # noqa: BLE001
            res["transports"].setdefault(label, {})["error"] = traceback.format_exc()
            log(traceback.format_exc())
    if "memcpy" not in skip:
        res["memcpy"] = {}
        for p in points:
            res["memcpy"][C.point_name(p)] = memcpy_ref(p, a.rounds)
        log("  memcpy GB/s (block / numpy pages): " + ", ".join(
            f"{k} {v['memcpy_gbps']:.2f}/{v['numpy_pages_gbps']:.2f}" for k, v in res["memcpy"].items()))
    res["loadavg_end"] = os.getloadavg()
    res["wall_s"] = time.monotonic() - t_start
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer points and samples")
    ap.add_argument("--only", choices=["tcp", "shm"], help="one transport")
    ap.add_argument("--skip", default="",
                    help="comma list of: kvrecv,scale,nixl,mooncake,cref,perftest,memcpy")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per point (>= 5)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the whole suite N times; the summary adds each point's kv/NIXL "
                         "ratio in every run and the worst of them (the tables show the last run)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "results.json"))
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild targets, summary.md and the plot from an existing --out file")
    a = ap.parse_args()
    if a.report_only:
        with open(a.out) as f:
            res = json.load(f)
        res["targets"] = evaluate(res)
        C.dump(a.out, res)
        md = summary_md(res)
        with open(os.path.join(os.path.dirname(os.path.abspath(a.out)), "summary.md"), "w") as f:
            f.write(md)
        plot(res, os.path.join(os.path.dirname(os.path.abspath(a.out)), "throughput.png"))
        log(md)
        return
    skip = set(filter(None, a.skip.split(",")))
    if "perftest" not in skip and not shutil.which("ucx_perftest"):
        log("ucx_perftest: not run: not installed (Debian: apt-get install ucx-utils)")
        skip.add("perftest")
    a.rounds = max(5, a.rounds)
    a.repeat = max(1, a.repeat)
    a.lat_samples = 150 if a.quick else 300
    a.out = os.path.abspath(a.out)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvrecv-bench-")
    points = throughput_points(a.quick)
    exe, cref = None, {}
    if "cref" not in skip:
        try:
            exe, cref["c_ref_build"] = build_c_ref()
        except Exception as e:  # noqa: BLE001
            cref["c_ref_build_error"] = str(e)
            log(str(e))
    if "mooncake" not in skip:
        try:
            import mooncake.engine  # noqa: F401
        except ImportError as e:
            log(f"Mooncake: not run: {e} (pip install --no-deps mooncake-transfer-engine-non-cuda)")
            skip.add("mooncake")
    repeats, builds = [], []
    for i in range(a.repeat):
        if a.repeat > 1:
            log(f"=== suite run {i + 1} of {a.repeat}")
        res = run_suite(a, points, skip, exe, tmp)
        res.update(cref)
        repeats.append(repeat_record(res))
        builds.extend(b for b in core_builds(res) if b not in builds)
        if a.repeat > 1:
            res["repeats"] = repeats
        res["core_builds"] = builds
        res["targets"] = evaluate(res)
        C.dump(a.out, res)
    md = summary_md(res)
    with open(os.path.join(os.path.dirname(a.out), "summary.md"), "w") as f:
        f.write(md)
    try:
        plot(res, os.path.join(os.path.dirname(a.out), "throughput.png"))
    except ImportError as e:
        log(f"throughput.png: not drawn: {e} (pip install matplotlib)")
    shutil.rmtree(tmp, ignore_errors=True)
    log("")
    log(md)
    log(f"suite wall time {res['wall_s']:.0f} s (the last of {a.repeat} runs); results in {a.out}")


if __name__ == "__main__":
    main()
