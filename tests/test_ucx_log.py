"""UCX's own log lines go to the "kvrecv" logger, not to stderr: a normal
transfer over shared memory leaves stderr free of UCX lines, the refusal
kvrecv expects (no peer-failure handling over shared memory) is logged at
DEBUG, and which transport UCX chose is said once at INFO."""

from __future__ import annotations

import logging
import time

import pytest

from failtest import _decode, _open_receiver, _wait_state, _wait_until
from kvrecv import BootstrapServer, KVConfig, KVPoll, KVReceiver, KVSender
from kvtest import SMALL, Side, terminal, wait_for, wait_until
from peer_proc import PeerProcess

pytestmark = pytest.mark.timeout(60)


def test_a_shared_memory_transfer_leaves_stderr_free_of_ucx_lines(res, caplog, capfd,
                                                                  monkeypatch):
    monkeypatch.setenv("UCX_TLS", "posix,sysv,cma,self")
    caplog.set_level(logging.DEBUG, logger="kvrecv")
    bs = res.server()
    prefill = res.manager(Side(SMALL, 0, seed=2), "prefill", bs.address)
    decode = res.manager(Side(SMALL, 0), "decode")
    r = KVReceiver(decode, bs.address, 3)
    r.init()
    assert wait_for(r, (KVPoll.WaitingForInput, KVPoll.Failed)) == KVPoll.WaitingForInput
    r.send_metadata([1, 2])
    s = KVSender(prefill, bs.address, 3)
    s.init(2)
    s.send([4, 5])
    assert wait_for(r, terminal()) == KVPoll.Success
    assert wait_for(s, terminal()) == KVPoll.Success
    r.clear()
    s.clear()

    def records(level, start):
        return [m.getMessage() for m in caplog.records
                if m.name == "kvrecv" and m.levelno == level and m.getMessage().startswith(start)]

    # Both sides asked UCX for peer-failure handling once and were refused.
    assert wait_until(lambda: len(records(logging.DEBUG, "UCX: no active messages transport")) == 2,
                      5), caplog.text
    refusal = records(logging.DEBUG, "UCX: no active messages transport")[0]
    assert "no peer failure handler" in refusal and refusal.endswith(")"), refusal
    assert wait_until(lambda: len(records(logging.INFO, "UCX connects to peers over ")) == 2, 5)
    said = records(logging.INFO, "UCX connects to peers over ")
    version = decode.transport.split(",")[0].split()[1]  # "ucx 1.13.1, UCX_TLS=..."
    assert said[0].endswith(f"(UCX_TLS=posix,sysv,cma,self): shared memory, where UCX {version} "
                            "has no peer-failure handling, so heartbeats detect a dead peer"), said
    assert not [m for m in caplog.records if m.name == "kvrecv" and m.levelno >= logging.WARNING
                and m.getMessage().startswith("UCX")], caplog.text
    err = capfd.readouterr().err
    assert "UCX" not in err, err


def test_a_peer_killed_mid_transfer_leaves_no_ucx_warning(caplog, monkeypatch):
    """Over shared memory (no peer-failure handling) a prefill is killed with
    rendezvous receives of the decode in flight that nothing can complete
    or cancel (UCX 1.13 cancels no active-message receive).  The dead
    peer's worker is destroyed with them and its pools: UCX's "object ...
    was not returned to mpool" lines for them are logged at DEBUG, never as
    a WARNING, also when the decode manager closes."""
    scale = 131072  # KV items of 128..512 KiB: a 8-page room is 10 MiB
    monkeypatch.setenv("UCX_TLS", "posix,sysv,self")
    caplog.set_level(logging.DEBUG, logger="kvrecv")

    def unreturned(level):
        return [m.getMessage() for m in caplog.records if m.name == "kvrecv"
                and m.levelno == level and "was not returned to mpool" in m.getMessage()]

    bs = BootstrapServer("127.0.0.1", 0)
    # UCX's rendezvous, not the decode's cross-memory reads (which leave no
    # UCX receive in flight): the decode does not offer them.
    d, dkv, _ = _decode(config=KVConfig(cross_memory_bytes=0), scale=scale)
    try:
        for trial in range(4):
            child = PeerProcess("prefill", bs.address, seed=40 + trial, scale=scale)
            try:
                plan = {8100 + 10 * trial + i: list(range(8 * i, 8 * i + 8)) for i in range(4)}
                rooms = {rid: _open_receiver(d, bs.address, rid, pg) for rid, pg in plan.items()}
                for rid, pg in plan.items():
                    child.call("open_sender", room=rid, n=len(pg))
                base = d.stats()["bytes_moved"]
                for rid, pg in plan.items():
                    child.call("send", room=rid, pages=pg)
                t0 = time.monotonic()
                while d.stats()["bytes_moved"] == base and time.monotonic() - t0 < 20:
                    time.sleep(0.0005)
                child.freeze()
                time.sleep(0.2)
            finally:
                child.kill()
                child.close()
            for r in rooms.values():
                _wait_state(r, (KVPoll.Failed, KVPoll.Success), 10)
            _wait_until(lambda: d.stats()["ucx_workers"] == 0, 10, "the dead prefill's worker gone")
            for r in rooms.values():
                r.clear()
            if wait_until(lambda: unreturned(logging.DEBUG), 1):
                break
    finally:
        d.close()
        bs.close()
    assert unreturned(logging.DEBUG), "no trial left a receive in flight: " + caplog.text[-2000:]
    assert unreturned(logging.WARNING) == [], unreturned(logging.WARNING)
