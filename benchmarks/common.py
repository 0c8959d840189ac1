"""Shared pieces of the kvrecv benchmarks: KV layouts and transfer plans,
buffer patterns, CPU/RSS accounting and statistics.

A *point* is one layout: `nbuf` KV buffers (layers x K/V) of `item` bytes
per page, rooms of `pages` pages, `rooms` rooms moved per round, and the
page pattern `contig` (each room is one run of consecutive pages on both
sides) or `random` (source and destination pages drawn at random, so almost
every page is its own run).  Every implementation (kvrecv, NIXL, the C put
loop, memcpy) moves the same plan: the same (source page, destination page)
pairs per room.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import struct
import time
from typing import Dict, List, Sequence, Tuple

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# UCX_TLS of the two transports every section runs with.
TRANSPORTS = {"tcp": "tcp", "shm": "posix,sysv,cma,self"}
# NIXL's UCX backend asks for peer-failure handling, which UCX offers on no
# shared-memory-only transport set; with tcp added, its puts still go over
# cma (UCX_PROTO_INFO=y shows "remote memory write ... zero-copy cma/memory").
NIXL_SHM_TLS = "posix,sysv,cma,tcp,self"

# Timeouts that keep a loaded 2-core machine from turning a scheduling stall
# into PEER_LOST (the library's default declares a peer lost after 600 ms
# of heartbeat silence).  Used by the throughput, latency and poll sections;
# the scale section runs with the library defaults.
ROBUST_CONFIG = dict(heartbeat_timeout_ms=15000, bootstrap_timeout_ms=20000)

KiB = 1024
MiB = 1024 * 1024


def point_name(p: Dict) -> str:
    return f"{p['layout']}-b{p['nbuf']}-i{p['item'] // KiB}k-p{p['pages']}-r{p['rooms']}"


def pool_pages(p: Dict) -> int:
    return p["pages"] * p["rooms"]


def room_bytes(p: Dict) -> int:
    return p["pages"] * p["nbuf"] * p["item"]


def round_bytes(p: Dict) -> int:
    return room_bytes(p) * p["rooms"]


def make_plan(p: Dict, seed: int = 12345) -> List[Tuple[np.ndarray, np.ndarray]]:
    """[(src_pages, dst_pages)] per room, int32; destination pages of the
    rooms are disjoint, and so are the source pages."""
    rng = np.random.default_rng(seed)
    n, k = p["pages"], p["rooms"]
    plan = []
    if p["layout"] == "contig":
        for r in range(k):
            src = np.arange(r * n, (r + 1) * n, dtype=np.int32)
            dst = np.arange(((r + 1) % k) * n, ((r + 1) % k + 1) * n, dtype=np.int32)
            plan.append((src, dst))
    elif p["layout"] == "random":
        src_all = rng.permutation(n * k).astype(np.int32)
        dst_all = rng.permutation(n * k).astype(np.int32)
        for r in range(k):
            plan.append((src_all[r * n:(r + 1) * n].copy(), dst_all[r * n:(r + 1) * n].copy()))
    else:
        raise ValueError(p["layout"])
    return plan


def runs_of(src: np.ndarray, dst: np.ndarray) -> List[Tuple[int, int, int]]:
    """(src_start, dst_start, npages) for each run where both sides are
    consecutive, in room order (what a run-merging sender posts)."""
    out = []
    i, n = 0, len(src)
    if n == 0:
        return out
    brk = np.nonzero((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [n]))
    for s, e in zip(starts.tolist(), ends.tolist()):
        out.append((int(src[s]), int(dst[s]), e - s))
    return out


def write_plan_file(path: str, p: Dict, plan) -> None:
    """Binary plan for the C reference: header of 5 uint32 (nbuf, pool
    pages, rooms, pages per room, item) + uint64 item, then per room the
    source and destination pages (int32)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<IIIIQ", p["nbuf"], pool_pages(p), p["rooms"], p["pages"], p["item"]))
        for src, dst in plan:
            f.write(np.asarray(src, dtype="<i4").tobytes())
            f.write(np.asarray(dst, dtype="<i4").tobytes())


# --------------------------------------------------------------------------
# Buffers with a checkable pattern
# --------------------------------------------------------------------------


def dest_pool(p: Dict) -> List[np.ndarray]:
    """The receiving side's page pool of point p, one array per buffer, each
    page written once, as a serving engine's KV pool is when it starts.  An
    untouched page (np.zeros maps none) makes the first bytes that land in
    it pay the kernel's zero-fill fault, about 2 us per 4 KiB page here: a
    one-page room of 64 buffers took 230 us instead of 100 us until its
    pages had been written once."""
    bufs = [np.empty(pool_pages(p) * p["item"], dtype=np.uint8) for _ in range(p["nbuf"])]
    for b in bufs:
        b.fill(0)
    return bufs


def fill_pattern(buf: np.ndarray, b: int) -> None:
    """Fills KV buffer b (uint8) so that every 8-byte word says (b, offset)."""
    w = buf.view(np.uint64)
    w[:] = np.arange(w.size, dtype=np.uint64)
    w += np.uint64(b) << np.uint64(48)


def sample_pages(nbuf: int, plan, samples: int = 64, seed: int = 7) -> List[Tuple[int, int, int]]:
    """(buffer, room, index in room) triples to verify after a round."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(samples):
        r = int(rng.integers(len(plan)))
        out.append((i % nbuf, r, int(rng.integers(len(plan[r][0])))))
    return out


def clear_samples(dst_bufs: Sequence[np.ndarray], item: int, plan, samples) -> None:
    """Zeroes the sampled destination pages, so that a stale page from an
    earlier round cannot pass the check."""
    for b, r, j in samples:
        d = int(plan[r][1][j])
        dst_bufs[b][d * item:(d + 1) * item] = 0


def check_pages(dst_bufs: Sequence[np.ndarray], item: int, plan, samples) -> List[str]:
    """Checks that the sampled destination pages hold their source pages."""
    bad = []
    words = item // 8
    for b, r, j in samples:
        src, dst = plan[r]
        w = dst_bufs[b].view(np.uint64).reshape(-1, words)
        want = np.arange(int(src[j]) * words, (int(src[j]) + 1) * words, dtype=np.uint64)
        want += np.uint64(b) << np.uint64(48)
        got = w[int(dst[j])]
        if not np.array_equal(got, want):
            holds = int(got[0] & np.uint64((1 << 48) - 1)) // words
            bad.append(f"buffer {b} room {r} page {j}: dst page {int(dst[j])} should hold src page "
                       f"{int(src[j])}, holds {holds} (first word {int(got[0]):#x})")
    return bad


# --------------------------------------------------------------------------
# CPU, RSS, clocks
# --------------------------------------------------------------------------


def cpu_now() -> float:
    """User + system CPU seconds of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Mallinfo2(__import__("ctypes").Structure):
    _fields_ = [(n, __import__("ctypes").c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_bytes() -> int:
    """Bytes in use in the glibc malloc heap (all arenas, mmapped blocks
    included): where the C core's per-room state lives.  -1 if unknown."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        f = libc.mallinfo2
    except (OSError, AttributeError):
        return -1
    f.restype = _Mallinfo2
    m = f()
    return int(m.uordblks + m.hblkhd)


def thread_cpu() -> Dict[str, float]:
    """CPU seconds per thread name of this process (from /proc)."""
    out: Dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                data = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick
        key = "main" if tid == str(os.getpid()) else name
        out[key] = out.get(key, 0.0) + cpu
    return out


def core_build() -> Dict:
    """The kvrecv._core this process loaded: path, GNU build id, mtime
    (the tree is rebuilt by others; a run must not mix builds unnoticed)."""
    from kvrecv import _core

    path = _core.__file__
    out = {"path": path, "build_id": None, "mtime": None}
    try:
        out["mtime"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(os.path.getmtime(path)))
        with open(path, "rb") as f:
            data = f.read()
        i = data.find(struct.pack("<III", 4, 20, 3) + b"GNU\x00")
        if i >= 0:
            out["build_id"] = data[i + 16:i + 36].hex()
    except OSError:
        pass
    return out


def now_ns() -> int:
    """CLOCK_MONOTONIC: one clock for every process of the machine (Linux),
    so a timestamp taken in the prefill process can be subtracted from one
    taken in the decode process."""
    return time.monotonic_ns()


# --------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    return float(np.percentile(np.asarray(xs, dtype=float), q))


def summarize(xs: Sequence[float]) -> Dict:
    xs = list(xs)
    return {"median": median(xs), "min": min(xs) if xs else None, "max": max(xs) if xs else None,
            "n": len(xs)}


def _thread_sum(dicts, denom):
    tot = {}
    for d in dicts:
        for k, v in d.items():
            tot[k] = tot.get(k, 0.0) + v
    return {k: v / denom for k, v in sorted(tot.items()) if v > 0}


def _summarize_rounds(out: Dict, point: Dict) -> float:
    """What kvrecv's and NIXL's results share: GB/s (median and every
    round) and CPU seconds per GB of both processes.  Returns GB per round."""
    rounds = out["rounds"]
    gb = round_bytes(point) / 1e9
    out["gbps"] = median([r["gbps"] for r in rounds])
    out["gbps_all"] = [r["gbps"] for r in rounds]
    out["cpu_s_per_gb"] = {
        "decode": median([r["decode_cpu"] for r in rounds]) / gb,
        "prefill": median([r["prefill_cpu"] for r in rounds]) / gb,
        "total": median([r["decode_cpu"] + r["prefill_cpu"] for r in rounds]) / gb}
    return gb


def summarize_kv_rounds(out: Dict, point: Dict) -> Dict:
    """kvrecv's figures for a throughput point from out["rounds"]."""
    rounds = out["rounds"]
    if rounds:
        gb = _summarize_rounds(out, point)
        out["ops_per_room"] = median([r["ops_per_room"] for r in rounds])
        out["thread_cpu_s_per_gb"] = {
            side: _thread_sum([r[side + "_threads"] for r in rounds], gb * len(rounds))
            for side in ("decode", "prefill")}
        out["post_fraction"] = median([r["post_seconds"] / r["seconds"] for r in rounds])
        sends = [c for r in rounds for c in r["send_call_us"]]
        out["send_call_us"] = {"median": median(sends), "max": max(sends)}
        out["failed_rooms"] = sum(r["failed_rooms"] for r in rounds)
    return out


def summarize_nixl_rounds(out: Dict, point: Dict) -> Dict:
    """NIXL's figures for a throughput point from out["rounds"]."""
    rounds = out["rounds"]
    if rounds:
        _summarize_rounds(out, point)
        out["gbps_initiator_done"] = median(
            [round_bytes(point) / r["initiator_done_seconds"] / 1e9 for r in rounds])
        out["verify"] = "ok" if not any(r["bad"] for r in rounds) else [
            r["bad"] for r in rounds if r["bad"]][:2]
    return out


def merge_rounds(results: List[Dict], point: Dict, summarize_rounds) -> Dict:
    """One result from several requests for the same point (one round each,
    taken in turn with a reference's): every request's rounds, summarized
    again.  The first error, if any, is the result."""
    for r in results:
        if "error" in r:
            return r
    out = dict(results[0])
    out["rounds"] = [x for r in results for x in r["rounds"]]
    out["requests"] = len(results)
    out["wall_s"] = sum(r.get("wall_s", 0.0) for r in results)
    bad = [r["verify"] for r in results if r.get("verify", "ok") != "ok"]
    if "verify" in out:
        out["verify"] = "ok" if not bad else bad
    return summarize_rounds(out, point)


def serve_points(bench, extra) -> None:
    """Long-lived mode of a reference for run.py (see kv_bench.serve): one
    JSON request per stdin line, {"cmd": "point", "point", "rounds",
    "warmup", "reuse"}, answered by one "@@RESULT {...}" line with
    extra() merged in; {"cmd": "exit"} ends it."""
    import sys
    import traceback

    try:
        for line in sys.stdin:
            req = json.loads(line)
            if req["cmd"] == "exit":
                break
            t = time.monotonic()
            try:
                r = bench.point(req["point"], req["rounds"], req.get("warmup", 1),
                                req.get("reuse", False))
                r.update(extra())
            except Exception:  # noqa: BLE001
                r = {"error": traceback.format_exc()}
            r["wall_s"] = time.monotonic() - t
            print("@@RESULT " + json.dumps(r, default=_json_default), flush=True)
    finally:
        bench.close()


def save_result(name: str, obj) -> None:
    """benchmarks/results/<name>, written whole (a script's latest run)."""
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    dump(os.path.join(HERE, "results", name), obj)


def dump(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=_json_default)
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
