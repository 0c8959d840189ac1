"""UCX's own log lines go to the "kvrecv" logger, not to stderr: a normal
transfer over shared memory leaves stderr free of UCX lines, the refusal
kvrecv expects (no peer-failure handling over shared memory) is logged at
DEBUG, and which transport UCX chose is said once at INFO."""

from __future__ import annotations

import logging

import pytest

from kvrecv import KVPoll, KVReceiver, KVSender
from kvtest import SMALL, Side, terminal, wait_for, wait_until

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
