"""GPU check and throughput benchmark (real CUDA runtime; run by gpu_check.sh).

  gpu_bench.py check [--kinds src:dst] [--force-staging]
      one manager pair in this process, device (or host) buffers on GPU 0,
      random pages in several rooms, every byte compared; prints CHECK OK.
  gpu_bench.py abort
      a staged room into device pages aborted mid-transfer: nothing lands
      after poll() says Failed; prints ABORT CHECK OK.
  gpu_bench.py bench [--seconds S] [--json FILE]
      cudaMemcpy host<->device bandwidth (pinned), then kvrecv throughput
      device->device over the staged path (and over UCX's own cuda support
      when this UCX has it), and device-to-device cudaMemcpy; prints every
      figure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from gpumem import D2D, D2H, H2D, Cudart, MemSide, find_cudart, pages_with_runs  # noqa: E402
from kvtest import Layout  # noqa: E402

from kvrecv import BootstrapServer, KVConfig, KVManager, KVPoll, KVReceiver, KVSender, _core  # noqa: E402

CFG = dict(heartbeat_timeout_ms=15000, bootstrap_timeout_ms=20000)


def cudart() -> Cudart:
    info = _core.cuda_info()
    if not info["loaded"]:
        sys.exit(f"FAIL: no usable CUDA runtime: {info['error']}")
    return Cudart(info["path"])


def wait(room, states, timeout):
    deadline = time.monotonic() + timeout
    s = room.poll()
    while s not in states and time.monotonic() < deadline:
        time.sleep(0.0002)
        s = room.poll()
    return s


def transfer(prefill, decode, addr, room, sp, dp, aux=None, timeout=120):
    r = KVReceiver(decode, addr, room)
    r.init()
    if wait(r, (KVPoll.WaitingForInput, KVPoll.Failed), 30) != KVPoll.WaitingForInput:
        raise RuntimeError(f"room {room}: receiver did not become ready: {r.poll()!r}")
    r.send_metadata(dp, aux_index=aux)
    s = KVSender(prefill, addr, room)
    s.init(len(sp), aux)
    s.send(sp)
    for x in (r, s):
        st = wait(x, (KVPoll.Success, KVPoll.Failed), timeout)
        if st != KVPoll.Success:
            try:
                x.failure_exception()
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(f"room {room}: {e!r}") from None
            raise RuntimeError(f"room {room}: state {st!r} after {timeout} s")
    r.clear()
    s.clear()


def check(opts) -> int:
    cu = cudart()
    sk, dk = opts.kinds.split(":")
    L = Layout((128, 8192, 1024, 65536), 512, (48,), 16)
    nb = len(L.kv_item_lens) + len(L.aux_item_lens)
    src = MemSide(cu, L, [sk] * nb, seed=11)
    dst = MemSide(cu, L, [dk] * nb)
    cfg = KVConfig(**CFG, force_staging=opts.force_staging, staging_slots=4,
                   staging_slot_bytes=1 << 20)
    bs = BootstrapServer("127.0.0.1", 0)
    prefill = KVManager(src.args(), "prefill", bootstrap_addr=bs.address, config=cfg)
    decode = KVManager(dst.args(), "decode", config=cfg)
    print("prefill:", prefill.stats()["gpu_path"], "-", prefill.stats()["gpu_path_why"])
    print("decode: ", decode.stats()["gpu_path"], "-", decode.stats()["gpu_path_why"])
    rng = np.random.default_rng(1)
    want = [h.copy() for h in dst.host]
    for room in range(1, 6):
        sp, dp = pages_with_runs(rng, L.num_pages, 200, 100, 300, 64)
        transfer(prefill, decode, bs.address, room, sp, dp, aux=room)
        for b, item in enumerate(L.kv_item_lens):
            want[b].reshape(-1, item)[dp] = src.host[b].reshape(-1, item)[sp]
        want[-1].reshape(-1, 48)[room] = src.host[-1].reshape(-1, 48)[room]
    got = dst.snapshot()
    bad = [i for i in range(nb) if not np.array_equal(got[i], want[i])]
    ps, ds = prefill.stats(), decode.stats()
    print(f"staged ops prefill {ps['staged_ops']} decode {ds['staged_ops']}, "
          f"overflow {ds['staging_overflow']}, waits {ps['staging_waits']}")
    prefill.close()
    decode.close()
    bs.close()
    src.close()
    dst.close()
    if bad:
        print(f"CHECK FAILED: buffers {bad} differ")
        return 1
    if opts.force_staging and "cuda" in (sk, dk):
        side = ps if sk == "cuda" else ds
        if side["gpu_path"] != "staged" or side["staged_ops"] == 0:
            print("CHECK FAILED: force_staging did not stage")
            return 1
    print("CHECK OK")
    return 0


def abort_once(cu, L, src, dst, prefill, decode, addr, room, delay):
    """One room aborted by the decode from another thread `delay` seconds
    after send() began (send() posts from its caller's thread): returns
    (state, pages landed at Failed, bytes that changed after Failed)."""
    for p, h in zip(dst.bufs, dst.host):
        cu.upload(p, h)  # back to the canary
    recv = KVReceiver(decode, addr, room)
    recv.init()
    if wait(recv, (KVPoll.WaitingForInput, KVPoll.Failed), 30) != KVPoll.WaitingForInput:
        raise RuntimeError(f"room {room}: receiver not ready")
    pages = np.arange(L.num_pages, dtype=np.int32)[::-1].copy()  # one-page runs
    recv.send_metadata(pages)
    send = KVSender(prefill, addr, room)
    send.init(len(pages))
    aborter = threading.Timer(delay, recv.abort)
    aborter.start()
    send.send(pages)
    aborter.join()
    st = wait(recv, (KVPoll.Success, KVPoll.Failed), 30)
    at_failed = dst.snapshot()
    time.sleep(0.3)
    later = dst.snapshot()
    late = sum(int(np.count_nonzero(a != b)) for a, b in zip(at_failed, later))
    landed = int((at_failed[0].reshape(L.num_pages, -1) != MemSide.CANARY).any(axis=1).sum())
    wait(send, (KVPoll.Success, KVPoll.Failed), 30)
    recv.clear()
    send.clear()
    return st, landed, late


def abort(opts) -> int:
    """Staged rooms into device pages aborted after growing delays: nothing
    may land after poll() says Failed, and at least one abort must come
    mid-transfer (some pages landed, not all)."""
    cu = cudart()
    L = Layout((262144, 262144), 512, (), 0)
    src = MemSide(cu, L, ["host", "host"], seed=5)
    dst = MemSide(cu, L, ["cuda", "cuda"])
    cfg = KVConfig(**CFG, staging_slots=4, staging_slot_bytes=262144, coalesce_bytes=262144)
    bs = BootstrapServer("127.0.0.1", 0)
    prefill = KVManager(src.args(), "prefill", bootstrap_addr=bs.address, config=cfg)
    decode = KVManager(dst.args(), "decode", config=cfg)
    ok, mid = True, 0
    for i, delay in enumerate((0.0, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05)):
        st, landed, late = abort_once(cu, L, src, dst, prefill, decode, bs.address, 10 + i, delay)
        print(f"abort after {delay * 1e3:5.1f} ms: state {st.name}, pages landed before Failed "
              f"{landed} of {L.num_pages}, bytes after Failed {late}")
        ok &= late == 0 and (st == KVPoll.Failed or landed == L.num_pages)
        mid += st == KVPoll.Failed and 0 < landed < L.num_pages
    print(f"staged ops {decode.stats()['staged_ops']}, draining {decode.stats()['rooms_draining']}")
    for x in (prefill, decode, bs):
        x.close()
    src.close()
    dst.close()
    if not ok or not mid:
        print("ABORT CHECK FAILED" + ("" if mid else ": no abort came mid-transfer"))
        return 1
    print("ABORT CHECK OK")
    return 0


def memcpy_bw(cu: Cudart, kind: int, nbytes: int, reps: int) -> float:
    lib = cu.lib
    dev = cu.malloc(nbytes)
    other = None
    if kind == D2D:
        other = cu.malloc(nbytes)
        a, b = other, dev
    else:
        hp = ctypes.c_void_p()
        cu.check(lib.cudaHostAlloc(ctypes.byref(hp), ctypes.c_size_t(nbytes), 0), "cudaHostAlloc")
        a, b = (dev, hp.value) if kind == H2D else (hp.value, dev)
    cu.check(lib.cudaMemcpy(a, b, nbytes, kind), "cudaMemcpy")
    cu.sync()
    t = time.perf_counter()
    for _ in range(reps):
        cu.check(lib.cudaMemcpy(a, b, nbytes, kind), "cudaMemcpy")
    cu.sync()
    dt = time.perf_counter() - t
    if kind != D2D:
        lib.cudaFreeHost(hp)
    cu.free(dev)
    if other:
        cu.free(other)
    return nbytes * reps / dt / 1e9


def kv_bw(cu: Cudart, force_staging: bool, seconds: float, item: int = 1 << 20, nbuf: int = 4,
          pages: int = 64, kinds: tuple = ("cuda", "cuda"), **cfg) -> tuple:
    L = Layout((item,) * nbuf, pages, (), 0)
    src = MemSide(cu, L, [kinds[0]] * nbuf, seed=3)
    dst = MemSide(cu, L, [kinds[1]] * nbuf)
    conf = KVConfig(**CFG, force_staging=force_staging, **cfg)
    bs = BootstrapServer("127.0.0.1", 0)
    prefill = KVManager(src.args(), "prefill", bootstrap_addr=bs.address, config=conf)
    decode = KVManager(dst.args(), "decode", config=conf)
    path = f'{prefill.stats()["gpu_path"]}/{decode.stats()["gpu_path"]}'
    idx = np.arange(pages, dtype=np.int32)
    transfer(prefill, decode, bs.address, 1, idx, idx)  # warm-up
    n, room, t0 = 0, 2, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        transfer(prefill, decode, bs.address, room, idx, idx[::-1].copy())
        n += 1
        room += 1
    dt = time.perf_counter() - t0
    ok = all(np.array_equal(dst.read(b).reshape(pages, item)[::-1], src.host[b].reshape(pages, item))
             for b in range(nbuf))
    for x in (prefill, decode, bs):
        x.close()
    src.close()
    dst.close()
    return path, n * pages * item * nbuf / dt / 1e9, ok


def room_latency(cu: Cudart, kind: str, rooms: int = 300, item: int = 4096, nbuf: int = 1) -> dict:
    """p50/p99 in microseconds of one-page rooms (send() to the decode's
    poll() seeing Success), pages in `kind` memory on both sides."""
    L = Layout((item,) * nbuf, 64, (), 0)
    src = MemSide(cu, L, [kind] * nbuf, seed=5)
    dst = MemSide(cu, L, [kind] * nbuf)
    bs = BootstrapServer("127.0.0.1", 0)
    prefill = KVManager(src.args(), "prefill", bootstrap_addr=bs.address, config=KVConfig(**CFG))
    decode = KVManager(dst.args(), "decode", config=KVConfig(**CFG))
    page = np.array([7], dtype=np.int32)
    lat = []
    for room in range(1, rooms + 1):
        r = KVReceiver(decode, bs.address, room)
        r.init()
        if wait(r, (KVPoll.WaitingForInput, KVPoll.Failed), 30) != KVPoll.WaitingForInput:
            raise RuntimeError(f"room {room}: receiver not ready")
        r.send_metadata(page)
        s = KVSender(prefill, bs.address, room)
        s.init(1, None)
        t = time.perf_counter()
        s.send(page)
        while r.poll() not in (KVPoll.Success, KVPoll.Failed):
            pass
        lat.append((time.perf_counter() - t) * 1e6)
        if r.poll() != KVPoll.Success or wait(s, (KVPoll.Success, KVPoll.Failed), 30) != KVPoll.Success:
            raise RuntimeError(f"room {room}: failed")
        r.clear()
        s.clear()
    ok = np.array_equal(dst.read(0).reshape(64, item)[7], src.host[0].reshape(64, item)[7])
    for x in (prefill, decode, bs):
        x.close()
    src.close()
    dst.close()
    lat = sorted(lat[20:])  # the first rooms set up the endpoints
    return {"p50_us": lat[len(lat) // 2], "p99_us": lat[int(len(lat) * 0.99)], "bytes_ok": bool(ok)}


def device_name() -> dict:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        name, driver = [x.strip() for x in out.split(",")]
        return {"device": name, "driver": driver}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"device": "unknown (no nvidia-smi)", "driver": "unknown"}


def bench(opts) -> int:
    cu = cudart()
    names, ucx_cuda = _core.ucx_memory_types()
    res = {**device_name(), "cuda_runtime": _core.cuda_info()["path"],
           "runtime_version": _core.cuda_info()["runtime_version"], "ucx_memory_types": names}
    print(f"UCX memory types: {names}")
    size = 64 << 20
    for name, kind in (("cudaMemcpy H2D (pinned)", H2D), ("cudaMemcpy D2H (pinned)", D2H),
                       ("cudaMemcpy D2D", D2D)):
        bw = memcpy_bw(cu, kind, size, 20)
        res[name] = bw
        print(f"{name:40s} {bw:8.2f} GB/s")
    failed = 0
    big = dict(staging_slots=16, staging_slot_bytes=8 << 20, coalesce_bytes=8 << 20)
    for label, force, cfg in (
        ("kvrecv VRAM->VRAM staged, 8x4 MiB slots", True, {}),
        ("kvrecv VRAM->VRAM staged, 16x8 MiB slots", True, big),
        ("kvrecv VRAM->host staged, 16x8 MiB slots", True, dict(big, kinds=("cuda", "host"))),
        ("kvrecv host->VRAM staged, 16x8 MiB slots", True, dict(big, kinds=("host", "cuda"))),
        ("kvrecv host->host (reference)", False, dict(kinds=("host", "host"))),
    ):
        path, bw, ok = kv_bw(cu, force, opts.seconds, **cfg)
        res[label] = bw
        print(f"{label:40s} {bw:8.2f} GB/s  (paths {path}, bytes {'ok' if ok else 'WRONG'})")
        failed |= not ok
    slower = min(res["cudaMemcpy H2D (pinned)"], res["cudaMemcpy D2H (pinned)"])
    res["ratios"] = {k: res[k] / slower for k in res if k.startswith("kvrecv")}
    print("kvrecv / slower of cudaMemcpy H2D, D2H: "
          + ", ".join(f"{v:.2f}" for v in res["ratios"].values()))
    for kind in ("cuda", "host"):
        lat = room_latency(cu, kind)
        res[f"one-page room 1x4 KiB, {kind} pages"] = lat
        print(f"one-page room 1x4 KiB, {kind:4s} pages: p50 {lat['p50_us']:.0f} us, "
              f"p99 {lat['p99_us']:.0f} us, bytes {'ok' if lat['bytes_ok'] else 'WRONG'}")
        failed |= not lat["bytes_ok"]
    if ucx_cuda:
        path, bw, ok = kv_bw(cu, False, opts.seconds)
        res["kvrecv VRAM->VRAM ucx-cuda"] = bw
        print(f"{'kvrecv VRAM->VRAM ucx-cuda':40s} {bw:8.2f} GB/s  (path {path}, bytes "
              f"{'ok' if ok else 'WRONG'}; compare cudaMemcpy D2D above)")
        failed |= not ok
    else:
        print("UCX here has no cuda memory support: no ucx-cuda figure "
              "(set UCX_HOME / LD_LIBRARY_PATH to a CUDA-enabled UCX build to get one)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(res, f, indent=2)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--kinds", default="cuda:cuda")
    c.add_argument("--force-staging", action="store_true")
    sub.add_parser("abort")
    b = sub.add_parser("bench")
    b.add_argument("--seconds", type=float, default=5.0)
    b.add_argument("--json")
    opts = p.parse_args()
    if find_cudart() is None and not _core.cuda_info()["loaded"]:
        print("FAIL: no CUDA runtime found (set KVRECV_CUDART)")
        return 2
    return {"check": check, "abort": abort, "bench": bench}[opts.cmd](opts)


if __name__ == "__main__":
    sys.exit(main())
