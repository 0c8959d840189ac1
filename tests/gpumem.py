"""Device memory for the GPU tests and benchmarks, through the CUDA runtime's
C API with ctypes (the real libcudart, or the tests' fake one)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
from typing import Optional

import numpy as np

H2D, D2H, D2D = 1, 2, 3
HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_SRC = os.path.join(HERE, "fakecuda", "fakecudart.c")


def build_fake(out_dir: str) -> str:
    """Compiles the fake runtime into out_dir; returns the .so path."""
    out = os.path.join(out_dir, "libfakecudart.so")
    cc = os.environ.get("CC", "gcc")
    # -Bsymbolic: the fake's calls to its own functions (cudaSetDevice asks
    # cudaGetDeviceCount) stay inside it even when a real libcudart was
    # loaded globally before (torch, imported by the sglang tests).
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-pthread", "-Wl,-Bsymbolic", "-o", out,
                    FAKE_SRC],
                   check=True, capture_output=True, text=True)
    return out


def find_cudart() -> Optional[str]:
    for name in (os.environ.get("KVRECV_CUDART"), "libcudart.so.12", "libcudart.so.13",
                 "libcudart.so"):
        if not name:
            continue
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            pass
    found = ctypes.util.find_library("cudart")
    return found


class Cudart:
    def __init__(self, path: str):
        self.path = path
        lib = self.lib = ctypes.CDLL(path)
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.cudaMalloc.argtypes = [ctypes.POINTER(vp), sz]
        lib.cudaFree.argtypes = [vp]
        lib.cudaMemcpy.argtypes = [vp, vp, sz, ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
        self._ptrs = []

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA error {rc} ({self.lib.cudaGetErrorString(rc)!r})")

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        rc = self.lib.cudaGetDeviceCount(ctypes.byref(n))
        return n.value if rc == 0 else 0

    def malloc(self, n: int) -> int:
        p = ctypes.c_void_p()
        self.check(self.lib.cudaMalloc(ctypes.byref(p), n), f"cudaMalloc({n})")
        self._ptrs.append(p.value)
        return p.value

    def free(self, p: int) -> None:
        self._ptrs.remove(p)
        self.check(self.lib.cudaFree(p), "cudaFree")

    def free_all(self) -> None:
        while self._ptrs:
            self.free(self._ptrs[-1])

    def upload(self, dev: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        self.check(self.lib.cudaMemcpy(dev, host.ctypes.data, host.nbytes, H2D), "cudaMemcpy H2D")

    def download(self, dev: int, n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.uint8)
        self.check(self.lib.cudaMemcpy(out.ctypes.data, dev, n, D2H), "cudaMemcpy D2H")
        return out

    def sync(self) -> None:
        if hasattr(self.lib, "cudaDeviceSynchronize"):
            self.check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")

    def counters(self):
        """The fake runtime's counters: h2d, d2h, d2d, bytes, async, bad_kind."""
        arr = (ctypes.c_uint64 * 6)()
        self.lib.fakecuda_counters(arr)
        return dict(zip(("h2d", "d2h", "d2d", "bytes", "async", "bad_kind"), list(arr)))


def pages_with_runs(rng, num_pages: int, n: int, src_run: int, dst_run: int, run: int):
    """n source and n destination pages, each starting with a run of `run`
    consecutive pages (at src_run, dst_run), the rest shuffled.  No
    destination page twice (send_metadata refuses that); a source page may
    repeat."""
    src = rng.permutation(num_pages)[:n]
    src[:run] = np.arange(src_run, src_run + run)
    rest = np.setdiff1d(np.arange(num_pages), np.arange(dst_run, dst_run + run))
    dst = np.concatenate([np.arange(dst_run, dst_run + run), rng.permutation(rest)[:n - run]])
    return src.astype(np.int32), dst.astype(np.int32)


class MemSide:
    """One rank's buffers, each host (numpy) or device (cudaMalloc):
    kinds[i] for the KV buffers, then the aux buffers.  Source sides are
    filled with seeded random bytes, destinations with a canary."""

    CANARY = 0xA5

    def __init__(self, cu: Cudart, layout, kinds, seed=None, rank=0):
        self.cu, self.layout, self.kinds, self.rank = cu, layout, list(kinds), rank
        rng = np.random.default_rng(seed) if seed is not None else None
        sizes = [i * layout.num_pages for i in layout.kv_item_lens] + \
                [i * layout.aux_rows for i in layout.aux_item_lens]
        assert len(self.kinds) == len(sizes)
        self.host = []   # host copy of every buffer's initial contents
        self.bufs = []   # numpy array (host) or device pointer (int)
        for n, kind in zip(sizes, self.kinds):
            data = (rng.integers(0, 256, size=n, dtype=np.uint8) if rng is not None
                    else np.full(n, self.CANARY, dtype=np.uint8))
            self.host.append(data)
            if kind == "cuda":
                p = cu.malloc(n)
                cu.upload(p, data)
                self.bufs.append(p)
            else:
                self.bufs.append(data.copy())

    def args(self, mem_kinds=None):
        from kvrecv import KVArgs

        ptrs = [b if isinstance(b, int) else b.ctypes.data for b in self.bufs]
        lens = [len(h) for h in self.host]
        nkv = len(self.layout.kv_item_lens)
        a = KVArgs(self.rank, ptrs[:nkv], lens[:nkv], list(self.layout.kv_item_lens),
                   ptrs[nkv:], lens[nkv:], list(self.layout.aux_item_lens),
                   mem_kinds=self.kinds if mem_kinds is None else mem_kinds)
        a._keepalive = [b for b in self.bufs if not isinstance(b, int)]
        return a

    def read(self, i: int) -> np.ndarray:
        b = self.bufs[i]
        return self.cu.download(b, len(self.host[i])) if isinstance(b, int) else b.copy()

    def snapshot(self):
        return [self.read(i) for i in range(len(self.bufs))]

    def close(self) -> None:
        for b in self.bufs:
            if isinstance(b, int):
                self.cu.free(b)
        self.bufs = []
