"""Device memory: transfers through the staging path on a fake CUDA runtime
(tests/fakecuda: device memory the host cannot touch, asynchronous copies on
worker threads), abort safety during staged transfers, memory-kind
validation, and, marked `gpu`, the same on a real GPU where there is one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvrecv import KVArgs, KVConfig, KVManager, KVPoll, KVReceiver, KVSender, _core
from kvtest import ROBUST_CONFIG, Layout, describe_failure, terminal, wait_for
from gpumem import Cudart, MemSide, build_fake, pages_with_runs

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 3 KV buffers (one item larger than the small test slots' quarter), 2 aux.
GL = Layout((64, 4096, 512), 96, (24, 40), 8)


@pytest.fixture(scope="session")
def fake_path(tmp_path_factory):
    return build_fake(str(tmp_path_factory.mktemp("fakecuda")))


@pytest.fixture
def cu(fake_path, monkeypatch):
    """The fake runtime, loaded into kvrecv and into the test (one copy)."""
    monkeypatch.setenv("KVRECV_CUDART", fake_path)
    info = _core.cuda_info()
    if info["loaded"] and info["path"] != fake_path:
        pytest.skip(f"another CUDA runtime ({info['path']}) is already loaded in this process: "
                    "run tests/test_gpu.py on its own")
    assert info["loaded"], info
    assert info["devices"] == 1
    c = Cudart(fake_path)
    yield c
    c.free_all()


def managers(res, bootstrap, src, dst, **cfg):
    conf = KVConfig(**dict(ROBUST_CONFIG, **cfg))
    prefill = KVManager(src.args(), "prefill", bootstrap_addr=bootstrap.address, config=conf)
    res._managers.append(prefill)
    decode = KVManager(dst.args(), "decode", config=conf)
    res._managers.append(decode)
    return prefill, decode


def plan(rng, layout, n):
    """n source pages and n destination pages: shuffled with runs in them."""
    # a consecutive run on both sides, longer than a small slot
    return pages_with_runs(rng, layout.num_pages, n, 40, 70, 12)


def apply(want, src: MemSide, sp, dp, src_aux, dst_aux):
    """Applies one room's transfer to the model of the decode buffers."""
    L = src.layout
    nkv = len(L.kv_item_lens)
    for b, item in enumerate(L.kv_item_lens):
        want[b].reshape(-1, item)[dp] = src.host[b].reshape(-1, item)[sp]
    for a, item in enumerate(L.aux_item_lens):
        want[nkv + a].reshape(-1, item)[dst_aux] = src.host[nkv + a].reshape(-1, item)[src_aux]


def run_room(prefill, decode, addr, room, sp, dp, src_aux, dst_aux, chunks=3):
    recv = KVReceiver(decode, addr, room)
    recv.init()
    assert wait_for(recv, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput, \
        describe_failure(recv)
    recv.send_metadata(dp, aux_index=dst_aux)
    send = KVSender(prefill, addr, room)
    send.init(len(sp), src_aux)
    for c in np.array_split(sp, chunks):
        send.send(c)
    for r in (recv, send):
        assert wait_for(r, terminal(), 30) == KVPoll.Success, describe_failure(r)
    recv.clear()
    send.clear()


KINDS = {
    "device-to-device": ("cuda", "cuda"),
    "device-to-host": ("cuda", "host"),
    "host-to-device": ("host", "cuda"),
}


@pytest.mark.parametrize("name", sorted(KINDS))
@pytest.mark.parametrize("slots", ["small", "default"])
def test_staged_transfer_is_byte_exact(cu, res, bootstrap, monkeypatch, name, slots):
    monkeypatch.setenv("FAKECUDA_DELAY_US", "100")  # copies finish late, out of step
    sk, dk = KINDS[name]
    nb = len(GL.kv_item_lens) + len(GL.aux_item_lens)
    src = MemSide(cu, GL, [sk] * nb, seed=7)
    dst = MemSide(cu, GL, [dk] * nb)
    cfg = dict(staging_slots=2, staging_slot_bytes=16 << 10) if slots == "small" else {}
    prefill, decode = managers(res, bootstrap, src, dst, **cfg)
    before = cu.counters()
    rng = np.random.default_rng(3)
    want = [h.copy() for h in dst.host]
    for room in range(1, 4):
        sp, dp = plan(rng, GL, 40)
        run_room(prefill, decode, bootstrap.address, room, sp, dp, room, room + 1)
        apply(want, src, sp, dp, room, room + 1)
    got = dst.snapshot()
    for i in range(nb):
        bad = np.nonzero(got[i] != want[i])[0]
        assert len(bad) == 0, f"buffer {i}: {len(bad)} bytes differ, first at {bad[:8].tolist()}"
    after = cu.counters()
    assert after["bad_kind"] == before["bad_kind"]
    ps, ds = prefill.stats(), decode.stats()
    assert ps["gpu_path"] == ("staged" if sk == "cuda" else "host"), ps["gpu_path_why"]
    assert ds["gpu_path"] == ("staged" if dk == "cuda" else "host"), ds["gpu_path_why"]
    side_dev = ps if sk == "cuda" else ds
    assert side_dev["staged_ops"] > 0 and side_dev["staged_bytes"] > 0
    assert "cannot move cuda memory" in side_dev["gpu_path_why"]
    if sk == "cuda":
        assert after["d2h"] > before["d2h"]
        assert prefill.mem_kinds == ["cuda"] * nb
        if slots == "small":
            # 4096-byte items in 16 KiB slots: runs were cut, rooms waited
            assert ps["staging_waits"] > 0
    if dk == "cuda":
        assert after["h2d"] > before["h2d"]
        assert decode.mem_kinds == ["cuda"] * nb
    if sk == "host" and dk == "cuda" and slots == "small":
        # the host prefill coalesces past the decode's slot size
        assert ds["staging_overflow"] > 0
    for m in (prefill, decode):
        st = m.stats()
        assert st["rooms_draining"] == 0 and sum(st["failures_by_code"].values()) == 0


def test_auto_detects_device_buffers(cu, res, bootstrap):
    nb = len(GL.kv_item_lens) + len(GL.aux_item_lens)
    kinds = ["cuda", "host", "cuda", "host", "cuda"]
    src = MemSide(cu, GL, kinds, seed=1)
    dst = MemSide(cu, GL, ["host"] * nb)
    conf = KVConfig(**ROBUST_CONFIG)
    m = KVManager(src.args(mem_kinds="auto"), "prefill", bootstrap_addr=bootstrap.address,
                  config=conf)
    res._managers.append(m)
    assert m.mem_kinds == kinds
    assert m.stats()["gpu_path"] == "staged"
    h = KVManager(dst.args(mem_kinds=None), "decode", config=conf)
    res._managers.append(h)
    assert h.mem_kinds == ["host"] * nb and h.stats()["gpu_path"] == "host"
    # declared host: taken as said, never asked
    m2 = KVManager(dst.args(mem_kinds="host"), "decode", config=conf)
    res._managers.append(m2)
    assert m2.stats()["gpu_path"] == "host"


def test_abort_during_staged_transfer_lands_nothing_after_failed(cu, res, bootstrap, monkeypatch):
    monkeypatch.setenv("FAKECUDA_DELAY_US", "3000")  # every device copy takes 3 ms
    L = Layout((4096, 4096), 256, (), 0)
    src = MemSide(cu, L, ["cuda", "cuda"], seed=5)
    dst = MemSide(cu, L, ["cuda", "cuda"])
    prefill, decode = managers(res, bootstrap, src, dst, staging_slots=4,
                               staging_slot_bytes=8192, coalesce_bytes=8192)
    addr = bootstrap.address
    recv = KVReceiver(decode, addr, 9)
    recv.init()
    assert wait_for(recv, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput
    pages = np.arange(256, dtype=np.int32)[::-1].copy()  # 256 one-page runs
    recv.send_metadata(pages)
    send = KVSender(prefill, addr, 9)
    send.init(len(pages))
    send.send(pages)
    # wait until some bytes landed in device pages, then abort mid-transfer
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if decode.stats()["bytes_moved"] > 0:
            break
        time.sleep(0.001)
    assert decode.stats()["bytes_moved"] > 0
    recv.abort()
    assert wait_for(recv, terminal(), 20) == KVPoll.Failed
    at_failed = dst.snapshot()
    time.sleep(0.3)  # 100 copies' worth of time
    later = dst.snapshot()
    for i in range(2):
        moved = np.nonzero(at_failed[i] != later[i])[0]
        assert len(moved) == 0, f"buffer {i}: {len(moved)} bytes landed after Failed"
    moved_pages = int((at_failed[0].reshape(256, 4096) != MemSide.CANARY).any(axis=1).sum())
    assert 0 < moved_pages < 256, moved_pages  # it really was mid-transfer
    assert wait_for(send, terminal(), 20) == KVPoll.Failed
    assert decode.stats()["rooms_draining"] == 0


def test_close_during_staged_transfer(cu, res, bootstrap, monkeypatch):
    monkeypatch.setenv("FAKECUDA_DELAY_US", "2000")
    L = Layout((4096,), 128, (), 0)
    src = MemSide(cu, L, ["cuda"], seed=5)
    dst = MemSide(cu, L, ["cuda"])
    prefill, decode = managers(res, bootstrap, src, dst, staging_slots=2,
                               staging_slot_bytes=4096)
    recv = KVReceiver(decode, bootstrap.address, 3)
    recv.init()
    assert wait_for(recv, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput
    pages = np.arange(128, dtype=np.int32)
    recv.send_metadata(pages[::-1].copy())
    send = KVSender(prefill, bootstrap.address, 3)
    send.init(128)
    send.send(pages)
    time.sleep(0.05)
    decode.close()  # copies in flight: waited for, nothing crashes
    prefill.close()
    assert recv.poll() == KVPoll.Failed and send.poll() == KVPoll.Failed


def test_mem_kinds_validation(cu, res, bootstrap):
    from kvrecv import KVArgs

    side = MemSide(cu, GL, ["host"] * 5)
    with pytest.raises(ValueError, match="mem_kinds has 2 entries for 5 buffers"):
        side.args(mem_kinds=["host", "cuda"])
    with pytest.raises(ValueError, match=r"mem_kinds\[1\]='gpu'"):
        side.args(mem_kinds=["host", "gpu", "host", "host", "host"])
    with pytest.raises(TypeError, match=r"mem_kinds\[0\] must be a str"):
        side.args(mem_kinds=[1, 2, 0, 0, 0])
    with pytest.raises(TypeError, match="mem_kinds must be"):
        side.args(mem_kinds=42)
    with pytest.raises(ValueError, match="is not one of"):
        KVArgs(0, [1], [64], [64], mem_kinds="vram")
    # declared cuda, but the runtime says it is host memory
    with pytest.raises(ValueError, match=r"kv buffer 0 is declared 'cuda' but CUDA reports host"):
        KVManager(side.args(mem_kinds="cuda"), "decode")
    # a staged prefill needs a slot to hold one page of the widest item
    dev = MemSide(cu, GL, ["cuda"] * 5, seed=1)
    with pytest.raises(ValueError, match=r"staging_slot_bytes=1024 is smaller than kv_item_lens"):
        KVManager(dev.args(), "prefill", bootstrap_addr=bootstrap.address,
                  config=KVConfig(staging_slot_bytes=1024))
    with pytest.raises(ValueError, match="staging_slots is 0"):
        KVManager(dev.args(), "prefill", bootstrap_addr=bootstrap.address,
                  config=KVConfig(staging_slots=0))
    # a decode with no slots still works (heap staging), and says so
    m = KVManager(dev.args(), "decode", config=KVConfig(staging_slots=0))
    res._managers.append(m)
    assert m.stats()["gpu_path"] == "staged"


NO_CUDA_SCRIPT = r"""
import numpy as np, sys
from kvrecv import KVArgs, KVManager
bufs = [np.zeros(4096, dtype=np.uint8)]
m = KVManager(KVArgs(0, [bufs[0].ctypes.data], [4096], [64], mem_kinds="auto"), "decode")
s = m.stats()
print("AUTO", s["gpu_path"], "|", s["gpu_path_why"])
m.close()
try:
    KVManager(KVArgs(0, [bufs[0].ctypes.data], [4096], [64], mem_kinds=["cuda"]), "decode")
except RuntimeError as e:
    print("ERROR", e)
    sys.exit(0)
print("NO ERROR")
sys.exit(1)
"""


def test_cuda_buffer_without_a_cuda_runtime_fails_clearly(tmp_path):
    env = dict(os.environ, KVRECV_CUDART=str(tmp_path / "no-such-libcudart.so"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", NO_CUDA_SCRIPT], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "AUTO host | every buffer is host memory (CUDA runtime not loaded" in p.stdout
    err = p.stdout.split("ERROR", 1)[1]
    assert "kv buffer 0 is declared 'cuda' but the CUDA runtime is not available" in err
    assert "no-such-libcudart.so" in err


def test_ucx_memory_types_and_doctor_report():
    names, cuda = _core.ucx_memory_types()
    assert "host" in names.split(",")
    assert cuda == ("cuda" in names.split(","))
    p = subprocess.run([sys.executable, "-m", "kvrecv", "doctor", "--json"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    findings = json.loads(p.stdout)["findings"]
    checks = {f["check"]: f for f in findings}
    for c in ("cuda runtime", "ucx memory types", "gpu path"):
        assert c in checks, sorted(checks)
    assert checks["gpu path"]["detail"].split(":")[0] in ("host", "staged", "ucx-cuda")


# ---------------------------------------------------------------------------
# Real GPU (marked gpu): run in a fresh process without the fake runtime.
# ---------------------------------------------------------------------------


def _clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVRECV_", "FAKECUDA_"))}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def real_gpu():
    p = subprocess.run([sys.executable, "-c",
                        "import json; from kvrecv import _core; print(json.dumps(_core.cuda_info()))"],
                       env=_clean_env(), capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        pytest.fail(p.stderr)
    info = json.loads(p.stdout.strip().splitlines()[-1])
    if not info["loaded"] or info["devices"] < 1:
        reason = f"no usable GPU/CUDA runtime here: {info['error'] or info['device_error']}"
        print(f"SKIP gpu tests: {reason}")
        pytest.skip(reason)
    return info


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", ["cuda:cuda", "cuda:host", "host:cuda"])
@pytest.mark.parametrize("path", ["auto", "staged"])
def test_real_gpu_transfer(real_gpu, kinds, path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"), "check",
           "--kinds", kinds]
    if path == "staged":
        cmd.append("--force-staging")
    p = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=300)
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "CHECK OK" in p.stdout


@pytest.mark.gpu
def test_real_gpu_abort_lands_nothing_after_failed(real_gpu):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"), "abort"],
                       env=_clean_env(), capture_output=True, text=True, timeout=300)
    print(p.stdout, p.stderr)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "ABORT CHECK OK" in p.stdout


# Window pages for the list-state test: a list of 40 is 160 KiB, ten 16 KiB slots.
WL = Layout((64, 512), 96, (24,), 8)
WIN_ITEM, WIN_ROWS = 4096, 64


def _window_args(side: MemSide, state, kind):
    a = side.args()
    ptr = state if isinstance(state, int) else state.ctypes.data
    return KVArgs(0, a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens, a.aux_data_ptrs,
                  a.aux_data_lens, a.aux_item_lens, state_data_ptrs=[[ptr]],
                  state_data_lens=[[WIN_ITEM * WIN_ROWS]], state_item_lens=[[WIN_ITEM]],
                  state_types=["swa"], mem_kinds=side.kinds + [kind])


@pytest.mark.parametrize("order", ["consecutive", "scattered"])
def test_staged_window_list_fits_the_slots(cu, res, bootstrap, order):
    """Sliding-window pages (a state component that takes a list of slots,
    docs/layouts.md) in device memory: a window list longer than a staging
    slot moves in messages that each fit one slot, byte for byte, with the
    slots consecutive (one run) and scattered."""
    rng = np.random.default_rng(5)
    src_state = rng.integers(0, 256, size=WIN_ITEM * WIN_ROWS, dtype=np.uint8)
    dev = cu.malloc(len(src_state))
    cu.upload(dev, src_state)
    dst_state = np.full(WIN_ITEM * WIN_ROWS, MemSide.CANARY, dtype=np.uint8)
    src, dst = MemSide(cu, WL, ["host"] * 3, seed=7), MemSide(cu, WL, ["host"] * 3)
    conf = KVConfig(**dict(ROBUST_CONFIG, staging_slots=2, staging_slot_bytes=16 << 10))
    pre = KVManager(_window_args(src, dev, "cuda"), "prefill", bootstrap_addr=bootstrap.address,
                    config=conf)
    res._managers.append(pre)
    dec = KVManager(_window_args(dst, dst_state, "host"), "decode", config=conf)
    res._managers.append(dec)
    if order == "consecutive":
        sl, dl = list(range(20, 60)), list(range(0, 40))
    else:
        sl, dl = list(rng.permutation(WIN_ROWS)[:40]), list(rng.permutation(WIN_ROWS)[:40])
    recv = KVReceiver(dec, bootstrap.address, 1)
    recv.init()
    assert wait_for(recv, (KVPoll.WaitingForInput, KVPoll.Failed), 20) == KVPoll.WaitingForInput
    recv.send_metadata(np.arange(4, dtype=np.int32), state_indices=[dl])
    send = KVSender(pre, bootstrap.address, 1)
    send.init(4)
    send.send(np.arange(4, 8, dtype=np.int32), state_indices=[sl])
    for r in (recv, send):
        assert wait_for(r, terminal(), 30) == KVPoll.Success, describe_failure(r)
    for s, d in zip(sl, dl):
        assert np.array_equal(dst_state[d * WIN_ITEM:(d + 1) * WIN_ITEM], src_state[s * WIN_ITEM:(s + 1) * WIN_ITEM])
    for d in set(range(WIN_ROWS)) - set(dl):
        assert (dst_state[d * WIN_ITEM:(d + 1) * WIN_ITEM] == MemSide.CANARY).all(), d
    ps = pre.stats()
    assert ps["gpu_path"] == "staged", ps["gpu_path_why"]
    # 160 KiB of window pages in 16 KiB slots: at least ten staged messages.
    assert ps["staged_ops"] >= 10 and ps["staged_bytes"] >= 40 * WIN_ITEM, ps
    recv.clear()
    send.clear()
