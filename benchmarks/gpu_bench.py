"""GPU check and throughput benchmark (real CUDA runtime; run by gpu_check.sh).

  gpu_bench.py check [--kinds src:dst] [--force-staging]
      one manager pair in this process, device (or host) buffers on GPU 0,
      random pages in several rooms, every byte compared; prints CHECK OK.
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
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from gpumem import D2D, D2H, H2D, Cudart, MemSide, find_cudart  # noqa: E402
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
        sp = rng.permutation(L.num_pages)[:200].astype(np.int32)
        dp = rng.permutation(L.num_pages)[:200].astype(np.int32)
        sp[:64] = np.arange(100, 164)
        dp[:64] = np.arange(300, 364)
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
          pages: int = 64, **cfg) -> tuple:
    L = Layout((item,) * nbuf, pages, (), 0)
    src = MemSide(cu, L, ["cuda"] * nbuf, seed=3)
    dst = MemSide(cu, L, ["cuda"] * nbuf)
    conf = KVConfig(**CFG, force_staging=force_staging, **cfg)
    bs = BootstrapServer("127.0.0.1", 0)
    prefill = KVManager(src.args(), "prefill", bootstrap_addr=bs.address, config=conf)
    decode = KVManager(dst.args(), "decode", config=conf)
    path = prefill.stats()["gpu_path"]
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


def bench(opts) -> int:
    cu = cudart()
    names, ucx_cuda = _core.ucx_memory_types()
    res = {"ucx_memory_types": names}
    print(f"UCX memory types: {names}")
    size = 64 << 20
    for name, kind in (("cudaMemcpy H2D (pinned)", H2D), ("cudaMemcpy D2H (pinned)", D2H),
                       ("cudaMemcpy D2D", D2D)):
        bw = memcpy_bw(cu, kind, size, 20)
        res[name] = bw
        print(f"{name:40s} {bw:8.2f} GB/s")
    failed = 0
    for label, force, cfg in (
        ("kvrecv VRAM->VRAM staged, 8x4 MiB slots", True, {}),
        ("kvrecv VRAM->VRAM staged, 16x8 MiB slots", True,
         dict(staging_slots=16, staging_slot_bytes=8 << 20, coalesce_bytes=8 << 20)),
    ):
        path, bw, ok = kv_bw(cu, force, opts.seconds, **cfg)
        res[label] = bw
        print(f"{label:40s} {bw:8.2f} GB/s  (path {path}, bytes {'ok' if ok else 'WRONG'})")
        failed |= not ok
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
    b = sub.add_parser("bench")
    b.add_argument("--seconds", type=float, default=5.0)
    b.add_argument("--json")
    opts = p.parse_args()
    if find_cudart() is None and not _core.cuda_info()["loaded"]:
        print("FAIL: no CUDA runtime found (set KVRECV_CUDART)")
        return 2
    return check(opts) if opts.cmd == "check" else bench(opts)


if __name__ == "__main__":
    sys.exit(main())
