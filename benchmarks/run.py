"""The kvrecv benchmark suite.

    python benchmarks/run.py [--quick] [--only tcp|shm] [--skip nixl,cref,perftest,...]

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
round) are given beside the median ratios.
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

RESULTS = os.path.join(HERE, "results")
BUILD = os.path.join(HERE, "build")
KiB, MiB = C.KiB, C.MiB

# NIXL's UCX backend asks for peer-failure handling, which UCX offers on no
# shared-memory-only transport set; with tcp added, its puts still go over
# cma (UCX_PROTO_INFO=y shows "remote memory write ... zero-copy cma/memory").
NIXL_SHM_TLS = "posix,sysv,cma,tcp,self"


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


def build_c_ref():
    os.makedirs(BUILD, exist_ok=True)
    exe = os.path.join(BUILD, "ref_ucx_put")
    flags = cmd_out(["pkg-config", "--cflags", "--libs", "ucx"]).split()
    cmd = ["gcc", "-O2", "-Wall", "-o", exe, os.path.join(HERE, "ref_ucx_put.c")] + flags
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise RuntimeError("building ref_ucx_put failed: " + " ".join(cmd) + "\n" + p.stdout)
    return exe, " ".join(cmd)


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


# --------------------------------------------------------------------------
# Summary, targets, plot
# --------------------------------------------------------------------------


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def ratio(a, b):
    if a is None or b is None or b == 0 or (isinstance(a, float) and np.isnan(a)):
        return None
    return a / b


def best(d):
    xs = _get(d, "gbps_all")
    return max(xs) if xs else None


def pooled_perftest(tr, test, size):
    """Every ucx_perftest sample of (test, size) taken for this transport in
    the run (next to each point of that message size and in the extra
    series): ucx_perftest busy-polls both sides, so on a shared 2-core
    machine single series swing by 3x with the background load."""
    xs = []
    key = {"tag_bw": "tag_bw", "tag_bw -e": "tag_bw_e"}.get(test)
    for p in tr.get("points", []):
        if key and p.get("msg_size") == size and p.get(key):
            xs.extend(p[key].get("gbps_all", []))
    xs.extend(_get(tr, "perftest", f"{test}:{size}", "gbps_all") or [])
    return {"gbps": C.median(xs) if xs else None, "gbps_all": xs}


def evaluate(res):
    """Every target: the measured figure, the reference, the ratio (median
    against median; 'ratio_best' best round against best round) and a
    verdict on the median ratio."""
    t = []
    trs = res["transports"]

    def pts(label):
        return [p for p in _get(trs, label, "points") or [] if _get(p, "kvrecv", "gbps")]

    def add(target, case, kv, ref, goal, extra=None):
        r = ratio(_get(kv, "gbps"), _get(ref, "gbps"))
        x = {"target": target, "case": case, "kvrecv": _get(kv, "gbps"),
             "reference": _get(ref, "gbps"), "ratio": r, "ratio_best": ratio(best(kv), best(ref)),
             "goal": goal, "pass": r is not None and r >= goal, "unit": "GB/s"}
        x.update(extra or {})
        t.append(x)

    # 1. contiguous, shared memory, vs ucx_perftest tag_bw at the message size
    for p in pts("shm"):
        if p["point"]["layout"] == "contig":
            pool = pooled_perftest(trs["shm"], "tag_bw", p["msg_size"])
            add("contiguous, shm: >= 0.8x ucx_perftest tag_bw (same message size)",
                f"{p['name']} (msg {p['msg_size'] // KiB} KiB)", p["kvrecv"], pool, 0.8,
                {"ratio_adjacent": ratio(_get(p, "kvrecv", "gbps"), _get(p, "tag_bw", "gbps")),
                 "reference_samples": len(pool["gbps_all"])})
    # 2. random pages vs NIXL and vs the C put loop
    for label in ("tcp", "shm"):
        for p in pts(label):
            if p["point"]["layout"] != "random":
                continue
            note = {"note": f"NIXL under UCX_TLS={NIXL_SHM_TLS}"} if label == "shm" else {}
            add("random pages: >= 1.5x NIXL", f"{label} {p['name']}", p["kvrecv"],
                p.get("nixl"), 1.5, note)
            if p.get("nixl_prog_thread"):
                add("random pages: >= 1.5x NIXL, default config (progress thread)",
                    f"{label} {p['name']}", p["kvrecv"], p["nixl_prog_thread"], 1.5, note)
            # The issue's fallback reference, for when NIXL cannot run: a
            # target only then; beside NIXL's figure it is listed, not judged
            # (no verdict: "pass" None).
            fallback = _get(p, "nixl", "gbps") is None
            add("random pages: >= 1.5x put-loop reference (C ucp_put_nbx + flush)" if fallback
                else "random pages: put-loop reference (C ucp_put_nbx + flush), for information "
                     "(the target when NIXL cannot run)",
                f"{label} {p['name']}", p["kvrecv"], p.get("c_put"), 1.5,
                None if fallback else {"pass": None})
    # 2b. Mooncake's Python TransferEngine over tcp, same bytes
    for p in pts("tcp"):
        lay, item = p["point"]["layout"], p["point"]["item"]
        if lay == "contig" or item <= 16 * KiB:
            add(f"tcp, {'contiguous runs: >= 1x' if lay == 'contig' else 'random 4-16 KiB pages: >= 2x'}"
                " Mooncake TransferEngine", f"tcp {p['name']}", p["kvrecv"], p.get("mooncake"),
                1.0 if lay == "contig" else 2.0,
                None if _get(p, "mooncake", "gbps") else
                {"pass": None, "note": "Mooncake did not run: " + str(
                    _get(p, "mooncake", "error") or "not measured").strip().splitlines()[-1][:200]})
    # 3. latency
    for lat in _get(trs, "shm", "latency") or []:
        if "p50_us" not in lat:
            continue
        t.append({"target": "one-page room latency, shm: p50 <= 100 us",
                  "case": f"{lat['point']['nbuf']} buffers x {lat['point']['item'] // KiB} KiB, "
                          f"decode poll loop: {lat['mode']}",
                  "kvrecv": lat["p50_us"], "reference": 100.0, "ratio": lat["p50_us"] / 100.0,
                  "goal": "<= 1", "pass": lat["p50_us"] <= 100.0, "unit": "us",
                  "p99_us": lat["p99_us"]})
    # 4. poll
    for label in ("tcp", "shm"):
        pc = _get(trs, label, "poll")
        if pc and "per_receiver_ns" in pc:
            t.append({"target": "poll(): <= 1 us per receiver from Python",
                      "case": f"{label}, sweep over {pc['receivers']} receivers",
                      "kvrecv": pc["per_receiver_ns"], "reference": 1000.0,
                      "ratio": pc["per_receiver_ns"] / 1e3, "goal": "<= 1",
                      "pass": pc["per_receiver_ns"] <= 1000, "unit": "ns"})
    # 5. scale
    for label in ("tcp", "shm"):
        for o in _get(trs, label, "scale") or []:
            if o.get("rooms") != 8192:
                continue
            ok = (o.get("decode_failed") == 0 and o.get("prefill_failed") == 0
                  and o.get("decode_unfinished") == 0 and o.get("seconds") is not None)
            t.append({"target": "8192 rooms in flight without a failure", "case": label,
                      "kvrecv": o.get("decode_failed", "error"), "reference": 0, "ratio": None,
                      "goal": 0, "pass": ok, "unit": "failed rooms",
                      "note": f"{o.get('seconds') or float('nan'):.2f} s to move all rooms"})
            for side in ("decode", "prefill"):
                kib = o["rss_per_1000_rooms_kib"][side] / 1000
                t.append({"target": "RSS growth <= 2 KiB per room", "case": f"{label} {side}",
                          "kvrecv": kib, "reference": 2.0, "ratio": kib / 2.0, "goal": "<= 1",
                          "pass": kib <= 2.0, "unit": "KiB/room"})
    # 6. tcp vs ucx_perftest tag_bw at 16 MiB
    for p in pts("tcp"):
        if p["point"]["layout"] == "contig" and p["msg_size"] == 16 * MiB:
            pool = pooled_perftest(trs["tcp"], "tag_bw", 16 * MiB)
            add("tcp: >= 0.8x ucx_perftest tag_bw at 16 MiB", f"{p['name']} (msg 16 MiB)",
                p["kvrecv"], pool, 0.8,
                {"ratio_adjacent": ratio(_get(p, "kvrecv", "gbps"), _get(p, "tag_bw", "gbps")),
                 "reference_samples": len(pool["gbps_all"])})
            pool = pooled_perftest(trs["tcp"], "tag_bw -e", 16 * MiB)
            if pool["gbps_all"]:
                add("tcp: >= 0.8x ucx_perftest tag_bw at 16 MiB, endpoints with peer-failure "
                    "handling (-e) as kvrecv's", f"{p['name']} (msg 16 MiB)", p["kvrecv"], pool,
                    0.8, {"ratio_adjacent": ratio(_get(p, "kvrecv", "gbps"),
                                                   _get(p, "tag_bw_e", "gbps")),
                          "reference_samples": len(pool["gbps_all"])})
    return t


def core_builds(res):
    """Every kvrecv._core build id seen by a kvrecv process of the run."""
    seen = {}

    def note(b):
        if isinstance(b, dict) and b.get("build_id"):
            seen.setdefault(b["build_id"], b)

    for tr in res["transports"].values():
        for p in tr.get("points", []):
            note(_get(p, "kvrecv", "core_build"))
            note(_get(p, "kvrecv", "prefill_core_build"))
        for x in tr.get("latency", []) + [tr.get("poll") or {}] + tr.get("scale", []):
            note(x.get("core_build"))
    return list(seen.values())


def latency_runs(rs):
    """One latency case measured in several runs: p50/p90/p99 are medians
    over the runs that answered (min/max over all of them), *_all the
    per-run figures."""
    ok = [r for r in rs if "p50_us" in r and r["p50_us"] is not None]
    if not ok:
        return rs[-1]
    out = dict(ok[0])
    for k, agg in (("p50_us", C.median), ("p90_us", C.median), ("p99_us", C.median),
                   ("min_us", min), ("max_us", max)):
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = agg(vals) if vals else None
        out[k.replace("_us", "_us_all")] = vals
    out["runs"] = len(ok)
    out["samples"] = sum(r["samples"] for r in ok)
    out["failed"] = sum(r["failed"] for r in rs if "failed" in r)
    out["failures"] = [f for r in rs for f in r.get("failures", [])][:3]
    out["errors"] = [r["error"][-300:] for r in rs if "error" in r]
    return out


def fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if np.isnan(v):
            return "-"
        return f"{v:.{nd}f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def summary_md(res):
    out = []
    m = res["machine"]
    out.append(f"Machine: {m['cpu']}, {m['cpus']} CPUs, {m['memory_bytes'] / 2**30:.0f} GiB, "
               f"kernel {m['kernel']}; {' '.join(m['ucx']).strip('# ')}; Python {m['python']}; "
               f"kvrecv {m['kvrecv_commit'][:10]}{' (tree with local changes)' if m['kvrecv_tree_dirty'] else ''}; "
               f"NIXL {res.get('nixl_version', '-')}; load average {m['loadavg_start'][0]:.2f} at "
               f"start, {res.get('loadavg_end', [float('nan')])[0]:.2f} at end; "
               f"{'quick' if res['quick'] else 'full'} run, {res.get('wall_s', 0):.0f} s.")
    builds = res.get("core_builds") or []
    if len(builds) > 1:
        out.append("")
        out.append("**Warning: kvrecv/_core was rebuilt during the run; the processes loaded "
                   f"{len(builds)} builds: " + ", ".join(
                       f"{b['build_id'][:12]} ({b['mtime']})" for b in builds) + ".**")
    elif builds:
        out.append(f"kvrecv/_core build {builds[0]['build_id'][:12]} ({builds[0]['mtime']}).")
    out.append("")
    out.append("### Throughput (GB/s = 1e9 B/s, median of rounds)")
    out.append("")
    out.append("| transport | point | msg | kvrecv | ops/room | CPU s/GB | send() max ms | NIXL | C put "
               "| C get | tag_bw | memcpy | Mooncake | kv/NIXL | kv/Mooncake | kv/put | kv/tag_bw |")
    out.append("|" + "---|" * 17)
    for label, tr in res["transports"].items():
        for p in tr.get("points", []):
            kv = p.get("kvrecv", {})
            g = kv.get("gbps")
            out.append(
                f"| {label} | {p['name']} | {p['msg_size'] // KiB} KiB | {fmt(g)} | "
                f"{fmt(kv.get('ops_per_room'), 0)} | {fmt(_get(kv, 'cpu_s_per_gb', 'total'), 2)} | "
                f"{fmt((_get(kv, 'send_call_us', 'max') or float('nan')) / 1e3, 2)} | "
                f"{fmt(_get(p, 'nixl', 'gbps'))} | {fmt(_get(p, 'c_put', 'gbps'))} | "
                f"{fmt(_get(p, 'c_get', 'gbps'))} | {fmt(_get(p, 'tag_bw', 'gbps'))} | "
                f"{fmt(_get(res, 'memcpy', p['name'], 'memcpy_gbps'), 2)} | "
                f"{fmt(_get(p, 'mooncake', 'gbps'))} | "
                f"{fmt(ratio(g, _get(p, 'nixl', 'gbps')), 2)} | "
                f"{fmt(ratio(g, _get(p, 'mooncake', 'gbps')), 2)} | "
                f"{fmt(ratio(g, _get(p, 'c_put', 'gbps')), 2)} | "
                f"{fmt(ratio(g, _get(p, 'tag_bw', 'gbps')), 2)} |")
    out.append("")
    out.append("CPU s/GB: user+sys of both kvrecv processes per GB moved.  send() max: the longest "
               "KVSender.send() call of the rounds (it waits for the engine lock).  ops/room: prefill "
               "`rma_ops_posted` delta / rooms.  NIXL on shm runs with UCX_TLS="
               f"{NIXL_SHM_TLS} (it cannot start without tcp), progress thread off.")
    out.append("")
    out.append("### Latency, one-page rooms (us; CLOCK_MONOTONIC, prefill send() to decode poll()==Success)")
    out.append("")
    out.append("| transport | room | decode poll loop | p50 | p50 of each run | p90 | p99 | runs, samples | failed |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for label, tr in res["transports"].items():
        for lat in tr.get("latency", []):
            pt = lat.get("point", {})
            each = " ".join(fmt(v, 0) for v in lat.get("p50_us_all", []))
            out.append(f"| {label} | {pt.get('nbuf')} x {pt.get('item', 0) // KiB} KiB | "
                       f"{lat.get('mode')} | {fmt(lat.get('p50_us'), 1)} | {each} | "
                       f"{fmt(lat.get('p90_us'), 1)} | {fmt(lat.get('p99_us'), 1)} | "
                       f"{lat.get('runs', 1)}, {lat.get('samples')} | {lat.get('failed')} |")
    for label, tr in res["transports"].items():
        for x in tr.get("perftest_lat", []):
            each = " ".join(fmt(v, 1) for v in x.get("p50_us_all", []))
            out.append(f"| {label} | one {x['size'] // KiB} KiB message | ucx_perftest ucp_am_lat "
                       f"(busy-polls, half round trip) | {fmt(x.get('p50_us'), 1)} | {each} | | | "
                       f"{len(x.get('p50_us_all', []))} runs | |")
    out.append("")
    out.append("### poll() from Python (ns)")
    out.append("")
    out.append("| transport | per call, one receiver | per receiver, sweep of 4096 | whole sweep (us) "
               "| per receiver, `_core.Room.poll` | per receiver, loop + `id()` |")
    out.append("|---|---|---|---|---|---|")
    for label, tr in res["transports"].items():
        pc = tr.get("poll") or {}
        out.append(f"| {label} | {fmt(pc.get('per_call_ns'), 0)} | {fmt(pc.get('per_receiver_ns'), 0)}"
                   f" | {fmt(pc.get('per_iteration_us'), 0)} | "
                   f"{fmt(pc.get('per_receiver_ns_core_method'), 0)} | "
                   f"{fmt(pc.get('per_receiver_ns_loop_floor'), 0)} |")
    out.append("")
    out.append("### Scale (one manager pair; rooms of one page of 32 x 1 KiB; library default config)")
    out.append("")
    out.append("| transport | rooms | s to move all | rooms/s | failed dec/pre | RSS KiB/room dec "
               "| RSS KiB/room pre | heap B/room dec | heap B/room pre |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for label, tr in res["transports"].items():
        for o in tr.get("scale", []):
            if "rooms" not in o:
                out.append(f"| {label} | error: {str(o.get('error'))[:80]} | | | | | | | |")
                continue
            out.append(f"| {label} | {o['rooms']} | {fmt(o.get('seconds'), 3)} | "
                       f"{fmt(o.get('rooms_per_s'), 0)} | {o.get('decode_failed')}/{o.get('prefill_failed')}"
                       f" | {fmt(o['rss_per_1000_rooms_kib']['decode'] / 1000, 2)} | "
                       f"{fmt(o['rss_per_1000_rooms_kib']['prefill'] / 1000, 2)} | "
                       f"{fmt(o.get('decode_heap_per_room'), 0)} | {fmt(o.get('prefill_heap_per_room'), 0)} |")
    out.append("")
    out.append("### ucx_perftest (GB/s, median of all samples of the run; it busy-polls both sides and reuses one cache-resident buffer)")
    out.append("")
    out.append("| transport | test | size | GB/s | samples | min | max |")
    out.append("|---|---|---|---|---|---|---|")
    for label, tr in res["transports"].items():
        rows = {}
        for p in tr.get("points", []):
            for key, test in (("tag_bw", "tag_bw"), ("tag_bw_e", "tag_bw -e")):
                if p.get(key):
                    rows.setdefault((test, p["msg_size"]), []).extend(p[key].get("gbps_all", []))
        for v in (tr.get("perftest") or {}).values():
            rows.setdefault((v["test"], v["size"]), []).extend(v.get("gbps_all", []))
        for (test, size), xs in sorted(rows.items()):
            out.append(f"| {label} | {test} | {size // KiB} KiB | {fmt(C.median(xs) if xs else None)} | "
                       f"{len(xs)} | {fmt(min(xs) if xs else None)} | {fmt(max(xs) if xs else None)} |")
    out.append("")
    out.append("### Targets")
    out.append("")
    out.append("ratio: kvrecv median / reference median (for a time or size: measured / limit).  "
               "best: best round / best round.  adjacent: against the ucx_perftest series taken "
               "right after the point (the ucx_perftest verdicts use all samples of that size "
               "in the run).")
    out.append("")
    out.append("| target | case | measured | reference | ratio | best | adjacent | goal | verdict |")
    out.append("|---|---|---|---|---|---|---|---|---|")
    for x in res["targets"]:
        unit = x.get("unit", "")
        nd = {"us": 1, "ns": 0}.get(unit, 3)
        out.append(f"| {x['target']} | {x['case']} | {fmt(x['kvrecv'], nd)} {unit} | "
                   f"{fmt(x['reference'])} | {fmt(x['ratio'], 2)} | {fmt(x.get('ratio_best'), 2)} | "
                   f"{fmt(x.get('ratio_adjacent'), 2)} | {x['goal']} | "
                   f"{'info' if x['pass'] is None else 'PASS' if x['pass'] else 'FAIL'} |")
    return "\n".join(out) + "\n"


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    trs = [k for k in ("tcp", "shm") if k in res["transports"]]
    fig, axes = plt.subplots(1, len(trs), figsize=(7.5 * len(trs), 5.6), squeeze=False)
    for ax, label in zip(axes[0], trs):
        tr = res["transports"][label]
        sweep = [p for p in tr.get("points", []) if p["point"].get("sweep")]
        for layout, ls in (("contig", "-"), ("random", "--")):
            pts = sorted([p for p in sweep if p["point"]["layout"] == layout],
                         key=lambda p: p["point"]["item"])
            if not pts:
                continue
            x = [p["point"]["item"] // KiB for p in pts]
            series = [
                ("kvrecv", [_get(p, "kvrecv", "gbps") for p in pts], "tab:blue", "o"),
                ("NIXL" + (" (+tcp)" if label == "shm" else ""),
                 [_get(p, "nixl", "gbps") for p in pts], "tab:orange", "s"),
                ("C ucp_put_nbx loop", [_get(p, "c_put", "gbps") for p in pts], "tab:green", "^"),
                ("C ucp_get_nbx loop", [_get(p, "c_get", "gbps") for p in pts], "tab:olive", "v"),
                ("ucx_perftest tag_bw (msg size)", [_get(p, "tag_bw", "gbps") for p in pts],
                 "tab:red", "x"),
                ("memcpy, 1 thread", [_get(res, "memcpy", p["name"], "memcpy_gbps") for p in pts],
                 "tab:gray", "."),
            ]
            for name, ys, color, marker in series:
                xs = [a for a, b in zip(x, ys) if b is not None]
                ys = [b for b in ys if b is not None]
                if ys:
                    ax.plot(xs, ys, ls, color=color, marker=marker, label=f"{name}, {layout}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([4, 16, 64])
        ax.set_xticklabels(["4 KiB", "16 KiB", "64 KiB"])
        ax.set_xlabel("page size per KV buffer (item_len); 64 buffers, 64 MiB rooms, 2 per round")
        ax.set_ylabel("GB/s (median of rounds)")
        ax.set_yscale("log")
        lo, hi = ax.get_ylim()
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_yticks([v for v in (0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 4, 5, 7, 10, 15, 20)
                       if lo <= v <= hi])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_title(f"UCX_TLS={C.TRANSPORTS[label]}")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle("kvrecv throughput, contiguous (solid) and random (dashed) pages, beside the references")
    fig.tight_layout(rect=(0, 0.17, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


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
                    f"{fmt(r.get('ops_per_room'), 0)}, CPU {fmt(_get(r, 'cpu_s_per_gb', 'total'), 2)} s/GB"
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
            got = _get(r, "scale", "default")
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


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer points and samples")
    ap.add_argument("--only", choices=["tcp", "shm"], help="one transport")
    ap.add_argument("--skip", default="",
                    help="comma list of: kvrecv,scale,nixl,mooncake,cref,perftest,memcpy")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds per point (>= 5)")
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
    a.lat_samples = 150 if a.quick else 300
    reps_pt = 5
    a.out = os.path.abspath(a.out)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kvrecv-bench-")
    t_start = time.monotonic()
    points = throughput_points(a.quick)
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
           },
           "grid": {"throughput": points, "latency": [LAT_POINT, LAT_POINT_1],
                    "poll": POLL_POINT, "scale": {"point": SCALE_POINT, "counts": SCALE_COUNTS}}}
    exe = None
    if "cref" not in skip:
        try:
            exe, res["c_ref_build"] = build_c_ref()
        except Exception as e:  # noqa: BLE001
            res["c_ref_build_error"] = str(e)
            log(str(e))
    if "nixl" not in skip:
        nixl_probe(res)
    if "mooncake" not in skip:
        try:
            import mooncake.engine  # noqa: F401
        except ImportError as e:
            log(f"Mooncake: not run: {e} (pip install --no-deps mooncake-transfer-engine-non-cuda)")
            skip.add("mooncake")
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
    res["core_builds"] = core_builds(res)
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
    log(f"suite wall time {res['wall_s']:.0f} s; results in {a.out}")


if __name__ == "__main__":
    main()
