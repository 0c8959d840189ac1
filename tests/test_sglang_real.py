"""kvrecv as sglang's transfer backend, checked against sglang's own code
(the installed release, unpatched): its plugin loader, argument parser,
get_kv_class, HTTP clients of the bootstrap server, its KVTransferError
handling and poll_and_all_reduce.  Skipped where sglang is not installed;
with KVRECV_REQUIRE_SGLANG=1 (set by CI) a missing sglang is a failure."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvtest import STD, Side, wait_for

from kvrecv import KVPoll, KVTransferError
from kvrecv.sglang import (KVRecvBootstrapServer, KVRecvManager, KVRecvReceiver, KVRecvSender,
                           _route_source, advertise_host)
from kvrecv.sglang_http import fetch_json

try:
    import sglang  # noqa: F401
    import torch  # noqa: F401
    _MISSING = ""
except ImportError as e:  # pragma: no cover - depends on the machine
    _MISSING = f"sglang is not installed ({e}); scripts/setup_sglang.sh installs it"

if _MISSING and os.environ.get("KVRECV_REQUIRE_SGLANG") == "1":
    raise RuntimeError(f"KVRECV_REQUIRE_SGLANG=1 but {_MISSING}")

pytestmark = [pytest.mark.sglang, pytest.mark.skipif(bool(_MISSING), reason=_MISSING)]

from test_sglang import DisaggregationMode, cluster, sglang_kv_args  # noqa: E402,F401
from sglang_sched import Driver, ReqSpec, entry_point_dir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_py(code: str, tmp_path, env=None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([ROOT, entry_point_dir(str(tmp_path))])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=path, **(env or {})))


def test_sglang_loads_the_plugin_and_parses_the_flag(tmp_path):
    """sglang's own load_plugins() finds the entry point; then its parser
    takes --disaggregation-transfer-backend kvrecv and get_kv_class, as
    imported by decode.py, prefill.py and disagg_service.py, returns
    kvrecv's classes while the fake backend still resolves."""
    out = _run_py("""
        import argparse, json
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.server_args import ServerArgs
        from sglang.srt.disaggregation import decode, prefill, utils
        from sglang.srt.managers import disagg_service
        p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)
        a = p.parse_args(["--model-path", "x", "--disaggregation-transfer-backend", "kvrecv"])
        tb = utils.TransferBackend(a.disaggregation_transfer_backend)
        K = utils.KVClassType
        print(json.dumps({
            "flag": a.disaggregation_transfer_backend,
            "same_enum": decode.TransferBackend is prefill.TransferBackend is utils.TransferBackend,
            "decode": decode.get_kv_class(tb, K.RECEIVER).__qualname__,
            "prefill": prefill.get_kv_class(tb, K.SENDER).__qualname__,
            "server": disagg_service.get_kv_class(tb, K.BOOTSTRAP_SERVER).__qualname__,
            "kvargs": utils.get_kv_class(tb, K.KVARGS).__module__,
            "fake": utils.get_kv_class(utils.TransferBackend.FAKE, K.MANAGER).__qualname__,
        }))
    """, tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"flag": "kvrecv", "same_enum": True, "decode": "KVRecvReceiver",
                   "prefill": "KVRecvSender", "server": "KVRecvBootstrapServer",
                   "kvargs": "sglang.srt.disaggregation.base.conn", "fake": "FakeKVManager"}


def test_unsupported_sglang_is_refused_at_start(tmp_path):
    out = _run_py("""
        import sglang.version
        sglang.version.__version__ = "0.4.0"
        from kvrecv import sglang_plugin
        print(sglang_plugin.register())
    """, tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert ("kvrecv: sglang 0.4.0 is not a supported release (supported: 0.5.23); "
            "the 'kvrecv' transfer backend is not registered") in out.stderr


def test_sglang_http_clients_against_the_bootstrap(cluster):
    """sglang's own HTTP calls: the health check, the DP-rank registry its
    prefill fills and the batch query its decode makes."""
    import requests
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    base = f"http://{cluster.addr}"
    r = requests.get(f"{base}/health", timeout=5)
    assert (r.status_code, r.text) == (200, "OK")
    for room, dp in ((11, 0), (12, 0)):
        assert requests.post(f"{base}/register_dp_rank", json={"bootstrap_room": room, "dp_rank": dp},
                             timeout=5).status_code == 200
    assert CommonKVReceiver.query_prefill_dp_ranks(cluster.addr, [11, 12, 13]) == {"11": 0, "12": 0}
    info = requests.get(f"{base}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
                        "&target_pp_rank=-1", timeout=5).json()
    assert (info["attn_tp_size"], info["dp_size"], info["pp_size"], info["page_size"]) == (2, 1, 1, 1)
    one = requests.get(f"{base}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=1"
                       "&target_pp_rank=0", timeout=5).json()
    assert f"tcp://{one['rank_ip']}:{one['rank_port']}" == cluster.prefill[1].endpoint
    r = requests.get(f"{base}/route?prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=0"
                     "&target_pp_rank=0", timeout=5)
    assert (r.status_code, r.text) == (404, "Bootstrap info not found for dp_rank=1 cp_rank=0 "
                                            "tp_rank=0 pp_rank=0")


def _raw(addr: str, data: bytes) -> bytes:
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                return out
            out += chunk


@pytest.mark.parametrize("data,status", [
    (b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f", b"400"),          # a ZMTP greeting
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
    (b"DELETE /route HTTP/1.1\r\nHost: x\r\n\r\n", b"405"),
    (b"PUT /route HTTP/1.1\r\nHost: x\r\n\r\n", b"411"),
    (b"PUT /route HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n{", b"413"),
    (b"POST /query_dp_ranks HTTP/1.1\r\nContent-Length: 3\r\n\r\n[1]", b"400"),
    (b"GET /route?prefill_dp_rank=x HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
], ids=["zmtp", "unknown", "method", "no-length", "huge", "not-object", "bad-query"])
def test_bootstrap_http_junk_gets_4xx(cluster, data, status):
    reply = _raw(cluster.addr, data)
    assert reply.split(b" ")[1] == status, reply[:200]
    assert fetch_json(cluster.addr, "/health")[0] == 200  # still serving


def _put(addr, tp_rank, rank_port, instance):
    body = {"attn_tp_size": 2, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
            "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
            "rank_port": rank_port, "page_size": 1, "instance_id": instance}
    return fetch_json(addr, "/route", method="PUT", body=body)


def test_rank_table_refuses_a_live_rank_of_another_instance():
    """Ranks are keyed by (DP, CP, TP, PP): another instance may not take a
    live rank; a dead one's key is taken (a restarted prefill); the same
    instance re-registering (a restarted rank) always is."""
    live = socket.socket()
    live.bind(("127.0.0.1", 0))
    live.listen(1)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    server = KVRecvBootstrapServer(host="127.0.0.1", port=0)
    try:
        port = live.getsockname()[1]
        addr = server.address
        assert _put(addr, 0, port, "A") == (200, "OK")
        status, text = _put(addr, 0, dead_port, "B")
        assert status == 409 and text == (f"DP0 CP0 TP0 PP0 is held by live instance 'A' at "
                                          f"127.0.0.1:{port}")
        assert _put(addr, 0, dead_port, "A") == (200, "OK")  # rank 0 of A restarted
        assert _put(addr, 0, port, "B") == (200, "OK")  # A's rank 0 is gone: B takes it
    finally:
        server.close()
        live.close()


def _open_one(cluster, room, dst_pages, dst_aux):
    """Decode rank 0 and prefill rank 0 of one room, up to the prefill's
    WaitingForInput (sglang's pop_preallocated and pop_bootstrapped)."""
    recv = KVRecvReceiver(mgr=cluster.decode[0], bootstrap_addr=cluster.addr, bootstrap_room=room)
    send = KVRecvSender(mgr=cluster.prefill[0], bootstrap_addr=cluster.addr, bootstrap_room=room)
    recv.init(0)
    assert wait_for(recv, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    recv.send_metadata(dst_pages, dst_aux, None, decode_prefix_len=8 - len(dst_pages))
    assert wait_for(send, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    return recv, send


def test_full_prefix_hit_aux_leaves_with_last_chunk(cluster):
    """sglang's order on a full prefix hit: init(0, aux) at bootstrap, the
    aux row written later, then a 0-page last chunk.  The decode must see
    the row as it is at the last chunk, and not report Success before."""
    src, dst = cluster.src[0], cluster.dst[0]
    recv, send = _open_one(cluster, 501, np.zeros(0, dtype=np.int32), 3)
    src.rows(0)[5][:] = 7
    send.init(0, 5)
    time.sleep(0.3)
    assert recv.poll() != KVPoll.Success  # the last chunk is still to come
    src.rows(0)[5][:] = 42  # the scheduler fills the row at the last chunk
    assert send.should_send_kv_chunk(0, True) is True
    send.send(np.zeros(0, dtype=np.int32), None)
    assert wait_for(recv, KVPoll.Success) == KVPoll.Success
    assert (dst.rows(0)[3] == 42).all()
    recv.clear()
    send.clear()


def test_page_complete_chunk_that_is_not_last_keeps_the_aux_row(cluster):
    """All pages sent in a chunk that is not the last (page-aligned chunked
    prefill): the row must still leave with the last (0-page) chunk."""
    src, dst = cluster.src[0], cluster.dst[0]
    recv, send = _open_one(cluster, 502, np.arange(4, dtype=np.int32), 2)
    src.rows(0)[6][:] = 7
    send.init(4, 6)
    assert send.should_send_kv_chunk(4, False)
    send.send(np.array([10, 11, 12, 13], dtype=np.int32), None)
    time.sleep(0.3)
    assert recv.poll() != KVPoll.Success
    src.rows(0)[6][:] = 42
    assert send.should_send_kv_chunk(0, True)
    send.send(np.zeros(0, dtype=np.int32), None)
    assert wait_for(recv, KVPoll.Success) == KVPoll.Success
    assert (dst.rows(0)[2] == 42).all()
    assert (dst.pages(0)[3] == src.pages(0)[13]).all()
    recv.clear()
    send.clear()


def _sglang_failure(room) -> tuple:
    """What sglang's `except Exception as e:` in pop_transferred and
    process_disagg_prefill_inflight_queue reads."""
    try:
        room.failure_exception()
    except Exception as e:  # noqa: BLE001 - as sglang does
        from sglang.srt.disaggregation.common.conn import KVTransferError as SglError

        assert not isinstance(e, SglError)  # kvrecv's own class, same attributes
        return type(e).__name__, e.failure_reason, e.is_from_another_rank
    raise AssertionError("failure_exception() returned")


def test_sibling_abort_after_this_rank_finished_raises_the_origin(cluster):
    """Prefill rank 1 aborts after rank 0 finished its part: every rank
    (decode 0 and prefill 0 included, whose own part succeeded) raises the
    origin's code and reason once the MIN all-reduce says Failed."""
    room = 503
    recvs = [KVRecvReceiver(mgr=m, bootstrap_addr=cluster.addr, bootstrap_room=room)
             for m in cluster.decode]
    sends = [KVRecvSender(mgr=m, bootstrap_addr=cluster.addr, bootstrap_room=room)
             for m in cluster.prefill]
    for rv in recvs:
        rv.init(0)
        assert wait_for(rv, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        rv.send_metadata(np.arange(2, dtype=np.int32), 1, None, decode_prefix_len=0)
    for s in sends:
        assert wait_for(s, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
        s.init(2, 1)
    sends[0].should_send_kv_chunk(2, True)
    sends[0].send(np.array([3, 4], dtype=np.int32), None)
    assert wait_for(sends[0], KVPoll.Success) == KVPoll.Success
    assert wait_for(recvs[0], KVPoll.Success) == KVPoll.Success
    sends[1].abort()
    assert wait_for(recvs[1], KVPoll.Failed) == KVPoll.Failed
    time.sleep(0.5)  # the siblings publish the cause
    reason = f"room {room}: aborted by prefill rank 1"
    want_other = ("KVAbortedError", reason, True)
    assert _sglang_failure(sends[1])[:2] == ("KVAbortedError", reason)
    for rank_room in (sends[0], recvs[0], recvs[1]):
        got = _sglang_failure(rank_room)
        assert got[0] == want_other[0] and reason in got[1], got
    assert _sglang_failure(sends[0])[2] is not None
    for r in recvs + sends:
        r.clear()


def test_deferred_release_waits_for_the_room_to_drain(cluster):
    """sglang's deferred KV release: ensure_abort_notified(), then
    kv_mgr.is_abort_release_safe() only once no byte can land."""
    mgr = cluster.decode[0]
    assert mgr.enable_deferred_decode_kv_release is True
    rv = KVRecvReceiver(mgr=mgr, bootstrap_addr=cluster.addr, bootstrap_room=504)
    rv.init(0)
    assert wait_for(rv, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert rv.kv_mgr is mgr and not rv.abort_notified
    rv.ensure_abort_notified(force_arm=True)
    assert rv.abort_notified and len(rv.bootstrap_infos) == 1
    deadline = time.monotonic() + 10
    while not mgr.is_abort_release_safe(504, 1) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert mgr.is_abort_release_safe(504, 1)
    assert rv.poll() == KVPoll.Failed
    mgr.clear_deferred_abort_state(504)
    rv.clear()


def test_unreachable_bootstrap_is_a_logged_false_not_an_exception(cluster):
    """sglang's decode retries try_ensure_parallel_info, then aborts the
    receivers: the call itself must not raise."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert cluster.decode[0].try_ensure_parallel_info(f"127.0.0.1:{port}") is False
    rv = KVRecvReceiver(mgr=cluster.decode[0], bootstrap_addr=f"127.0.0.1:{port}", bootstrap_room=505)
    rv.init(0)
    assert rv.poll() == KVPoll.Failed
    assert _sglang_failure(rv) == (
        "KVTransferError", f"init() before the decode manager learnt the prefill at 127.0.0.1:{port} "
        "(try_ensure_parallel_info)", False)
    rv.clear()


def test_abort_after_an_unreachable_bootstrap_names_the_cause(cluster):
    """sglang gives up on a bootstrap server after its retries and aborts the
    receiver, never init()ed: the failure names the abort and why the
    manager could not learn the prefill."""
    mgr = cluster.decode[0]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    addr = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    assert mgr.try_ensure_parallel_info(addr) is False
    why = "ConnectionRefusedError: [Errno 111] Connection refused"
    assert mgr.bootstrap_failure(addr) == why
    rv = KVRecvReceiver(mgr=mgr, bootstrap_addr=addr, bootstrap_room=507)
    rv.abort()
    assert rv.poll() == KVPoll.Failed
    got = _sglang_failure(rv)
    assert got == ("KVBootstrapError", f"room 507: aborted by decode rank 0: could not learn the "
                                       f"prefill at {addr}: {why}", False)
    rv.clear()
    # an abort before init() of a receiver whose prefill was learnt stays an abort
    assert mgr.try_ensure_parallel_info(cluster.addr) is True
    assert mgr.bootstrap_failure(cluster.addr) is None
    rv = KVRecvReceiver(mgr=mgr, bootstrap_addr=cluster.addr, bootstrap_room=508)
    rv.abort()
    assert _sglang_failure(rv) == ("KVAbortedError", "room 508: aborted by decode rank 0", False)
    rv.clear()


def test_bootstrap_failures_kept_are_bounded(cluster):
    """The addresses come from requests: only the latest 1024 failed ones
    are kept, the oldest forgotten first."""
    mgr = cluster.decode[0]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    addrs = [f"127.0.{i // 250}.{i % 250 + 1}:{port}" for i in range(1030)]
    for a in addrs:
        assert mgr.try_ensure_parallel_info(a) is False
    assert [mgr.bootstrap_failure(a) for a in addrs[:6]] == [None] * 6
    assert mgr.bootstrap_failure(addrs[6]) == mgr.bootstrap_failure(addrs[-1]) == \
        "ConnectionRefusedError: [Errno 111] Connection refused"


def test_dp_rank_outside_the_prefill_fails_the_room(cluster):
    rv = KVRecvReceiver(mgr=cluster.decode[0], bootstrap_addr=cluster.addr, bootstrap_room=506)
    rv.init(1)
    assert rv.poll() == KVPoll.Failed
    assert _sglang_failure(rv)[1] == (f"prefill DP rank 1 asked for, but the prefill at "
                                      f"{cluster.addr} has dp_size=1")
    rv.clear()


def test_wildcard_host_advertises_a_routable_address(monkeypatch):
    monkeypatch.delenv("KVRECV_ADVERTISE_HOST", raising=False)
    got = advertise_host("0.0.0.0", "127.0.0.1")
    src = _route_source("192.0.2.1")
    if src and not src.startswith("127."):  # this machine has a non-loopback route
        assert not got.startswith("127."), got
    monkeypatch.setenv("KVRECV_ADVERTISE_HOST", "127.0.0.1")
    assert advertise_host("0.0.0.0", "10.1.2.3") == "127.0.0.1"
    assert advertise_host("127.0.0.1", "10.1.2.3") == "127.0.0.1"


def test_manager_keeps_sglangs_kv_args(cluster):
    """sglang reads kv_args.state_types (and more) back from the manager."""
    from sglang.srt.disaggregation.base.conn import KVArgs as SglKVArgs

    args = SglKVArgs()
    src = sglang_kv_args(Side(STD, rank=0))
    for k, v in vars(src).items():
        setattr(args, k, v)
    args.state_types = []
    mgr = KVRecvManager(args, DisaggregationMode.DECODE, cluster.server_args, False)
    try:
        assert mgr.kv_args is args and mgr.kv_args.state_types == []
        assert mgr.supports_host_destination is False
        assert mgr.siblings == []  # no process group in this process: no siblings
    finally:
        mgr.close()


def _sibling_rank(conn, rank, store_port, peer) -> None:
    """One rank of a 2-rank gloo group published as sglang's attention-TP
    group.  Rank 0 creates a decode manager; rank 1 does what `peer` says:
    "exit" (dies before the manager's gather), "junk" (meets the gather with
    an integer instead of an endpoint)."""
    import datetime
    import logging
    import types

    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=15))
        group = dist.new_group([0, 1], backend="gloo")
        get_parallel().override_permanently(attn_tp_group=types.SimpleNamespace(
            cpu_group=group, world_size=2, rank_in_group=rank))
        dist.barrier(group=group)
        if rank == 1:
            if peer == "exit":
                os._exit(0)
            dist.all_gather_object([None, None], 12345, group=group)
            conn.send(("ok", None))
            return
        warnings = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: warnings.append(record.getMessage())
        logging.getLogger("kvrecv").addHandler(handler)
        server_args = types.SimpleNamespace(host="127.0.0.1", disaggregation_bootstrap_port=9,
                                            tp_size=2)
        try:
            mgr = KVRecvManager(sglang_kv_args(Side(STD, rank=0)), DisaggregationMode.DECODE,
                                server_args, False)
        except Exception as e:  # noqa: BLE001 - reported to the test
            conn.send(("raised", (type(e).__name__, str(e), warnings)))
            return
        conn.send(("made", (mgr.siblings, warnings)))
        mgr.close()
    except Exception as e:  # noqa: BLE001
        conn.send(("error", repr(e)))


def _two_ranks(peer: str) -> tuple:
    import multiprocessing as mp

    from sglang_sched import free_port

    ctx = mp.get_context("fork")
    store = free_port()
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_sibling_rank, args=(pipes[r][1], r, store, peer), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        assert pipes[0][0].poll(60), "rank 0 gave no answer"
        return pipes[0][0].recv()
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)


@pytest.mark.timeout(120)
def test_sibling_gather_with_a_dead_rank_is_a_warning():
    """The other rank of the attention-TP group is gone when the manager
    gathers the endpoints: the manager is made, without siblings, and says
    so in a warning."""
    kind, (siblings, warnings) = _two_ranks("exit")
    assert kind == "made" and siblings == []
    [msg] = [w for w in warnings if "sibling" in w]
    assert msg.startswith("kvrecv: decode rank 0 could not learn its sibling ranks over sglang's "
                          "attention-TP group ("), msg
    assert msg.endswith("); a rank whose part of a room succeeded will raise the generic cause "
                        "when another rank's part fails"), msg


@pytest.mark.timeout(120)
def test_sibling_gather_of_a_wrong_set_is_refused():
    """The gather yields something that is not one endpoint per rank: the
    manager refuses to be made (sharing causes with a wrong set would put
    them on unrelated rooms) rather than join it."""
    kind, info = _two_ranks("junk")
    assert kind == "raised", info
    cls, text, _ = info
    assert cls == "_WrongSiblings"
    assert re.fullmatch(r"kvrecv: the attention-TP group gathered \['(tcp://127\.0\.0\.1:\d+)', "
                        r"12345\] as its ranks' endpoints, which is not one distinct endpoint "
                        r"per rank with '\1' at rank 0; refusing to share failure causes with it",
                        text), text


# --- sglang's own scheduler queues, ranks in separate processes ------------
#
# tests/sglang_sched.py runs sglang's DecodePreallocQueue, DecodeTransferQueue,
# PrefillBootstrapQueue and the prefill mixin's send_kv_chunk /
# process_disagg_prefill_inflight_queue, unpatched, with sglang's KV pools and
# MetadataBuffers, 2 decode ranks and 2 prefill ranks over gloo groups.

@pytest.fixture(scope="module")
def sched(tmp_path_factory):
    d = Driver(str(tmp_path_factory.mktemp("sglang_sched")))
    try:
        d.call("start_prefill")
        d.call("start_decode")
        yield d
    finally:
        d.close()


def _check_clean(d, out) -> None:
    """No scheduler method raised, no side timed out, no page or metadata
    slot left allocated on any rank.  What raised on any rank is reported
    before any timeout: a rank whose loop raised stops polling, and the
    other side then times out waiting for it."""
    ranks = [(f"{side} rank {rank}", r) for side in ("prefill", "decode")
             for rank, r in enumerate(out[side])]
    for key in ("raised", "timeout"):
        bad = [f"{where}: {r[key]}" for where, r in ranks if key in r]
        assert not bad, "\n".join(bad) + "\n" + d.log_tail()
    for where, r in ranks:
        assert r["leaked_tokens"] == 0, where
    for r in out["decode"]:
        assert r["leaked_meta"] == 0


def _ok(out, rid) -> None:
    for rank, r in enumerate(out["decode"]):
        got = r["reqs"][rid]
        assert got == {"status": "ok", "output_ids": [7], "bytes_ok": True}, (rank, got)
    for r in out["prefill"]:
        assert r["reqs"][rid]["status"] == "ok"


def _run_ok(d, specs) -> dict:
    """d.run(specs) where every request succeeds on every rank, byte for
    byte, and nothing raised, failed, timed out or leaked."""
    out = d.run(specs)
    _check_clean(d, out)
    for s in specs:
        _ok(out, s.rid)
    for r in out["decode"] + out["prefill"]:
        assert r["failures"] == {}
    return out


@pytest.mark.timeout(120)
def test_sglang_queues_move_requests_byte_exact(sched):
    """Requests through sglang's decode and prefill queues: each decode rank's
    KV pool holds, byte for byte, what its prefill rank wrote; the first
    output token arrives through sglang's MetadataBuffers."""
    _run_ok(sched, [ReqSpec("n1", 1101, 20), ReqSpec("n2", 1102, 1), ReqSpec("n3", 1103, 200)])


@pytest.mark.timeout(120)
def test_sglang_chunked_prefill_byte_exact(sched):
    """sglang's send_kv_chunk called once per prefill chunk (8 and 13 tokens a
    chunk, so the last chunk is short), then with last_chunk=True."""
    specs = [ReqSpec("c1", 1201, 37, chunk=8), ReqSpec("c2", 1202, 130, chunk=13)]
    out = sched.run(specs)
    _check_clean(sched, out)
    for s in specs:
        _ok(out, s.rid)
    assert out["prefill"][0]["calls"]["send_kv_chunk"] == 5 + 10


def _aborted(out, side, rid, rank) -> str:
    got = out[side][rank]["reqs"][rid]
    assert got["status"] == "aborted", got
    return got["message"]


def _causes(out, side, room, cls, reason) -> list:
    """What each rank's except-clause got for a failed room: exactly one
    failure, of class `cls`, whose reason is origin rank o's (reason(o,
    text) tells); is_from_another_rank is True exactly on the ranks other
    than the origin, and an origin rank raised its own cause.  Returns
    (origin, reason) per rank."""
    got = []
    for rank, r in enumerate(out[side]):
        failures = r["failures"][str(room)]
        assert len(failures) == 1, (side, rank, failures)
        [(c, text, other)] = failures
        origins = [o for o in range(len(out[side])) if reason(o, text)]
        assert c == cls and len(origins) == 1, (side, rank, failures)
        assert other is (origins[0] != rank), (side, rank, failures)
        got.append((origins[0], text))
    for o, _ in got:
        assert got[o][0] == o, (side, got)
    return got


def _check_causes(out, side, rid, room, cls, reason) -> list:
    """_causes(), and sglang's abort message of the request on every rank
    ends with the cause the rank raised."""
    got = _causes(out, side, room, cls, reason)
    for rank, (_, text) in enumerate(got):
        msg = _aborted(out, side, rid, rank)
        assert msg.startswith(f"{side.capitalize()} transfer failed for request rank={rank} "), msg
        assert msg.endswith(f"with exception KVTransferError(bootstrap_room={room}): {text}"), msg
    return got


@pytest.mark.timeout(120)
def test_sglang_prefill_abort_reaches_both_sides(sched):
    """The prefill scheduler's abort_request for an in-flight request (the
    sender's abort() after the first chunk) on both prefill ranks: every
    rank's except-clause gets KVAbortedError naming the prefill rank that
    aborted first (its own on that rank, the sibling's, with
    is_from_another_rank, on a rank sglang's MIN all-reduce failed first);
    the other request of the batch is unaffected; with deferred release
    (sglang's default) the decode held the pages until the room drained,
    then released them."""
    specs = [ReqSpec("a1", 1301, 40, chunk=8, prefill_abort=True), ReqSpec("a2", 1302, 10)]
    out = sched.run(specs)
    _check_clean(sched, out)
    _ok(out, "a2")
    for side in ("decode", "prefill"):
        _check_causes(out, side, "a1", 1301, "KVAbortedError",
                      lambda o, t: t == f"room 1301: aborted by prefill rank {o}")
    for rank in range(2):
        assert out["decode"][rank]["held_max"] == 1  # deferred release held a1's pages
        assert out["decode"][rank]["streamed"] == ["a1"]


@pytest.mark.timeout(120)
def test_sglang_unreachable_bootstrap_aborts_the_request(sched):
    """A request naming a bootstrap server nobody listens on: sglang's
    DecodePreallocQueue retries try_ensure_parallel_info, gives up, aborts
    the receiver, and its handshake except-clause gets KVBootstrapError with
    the abort (the rank whose retries ran out first: the sibling's abort on
    the other) and the refused connection behind it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = sched.run([ReqSpec("u1", 1401, 10, decode_only=True, bootstrap_port=port)])
    _check_clean(sched, out)
    head = "Decode handshake failed for request rank={} decode_req.req.rid='u1' " \
           "decode_req.req.bootstrap_room=1401 with exception KVTransferError(bootstrap_room=1401): "
    got = _causes(out, "decode", 1401, "KVBootstrapError",
                  lambda o, t: t == f"room 1401: aborted by decode rank {o}: could not learn the "
                                    f"prefill at 127.0.0.1:{port}: ConnectionRefusedError: "
                                    "[Errno 111] Connection refused")
    for rank, (_, text) in enumerate(got):
        assert _aborted(out, "decode", "u1", rank) == head.format(rank) + text
    assert f"Could not fetch prefill parallel info from 127.0.0.1:{port} after 15 attempts" \
        in sched.log_tail(200000)


@pytest.mark.timeout(180)
def test_sglang_killed_prefill_fails_the_transfer_then_recovers(sched):
    """Both prefill ranks SIGKILLed mid-transfer (after their first chunk):
    each decode rank's except-clause gets KVPeerLostError naming the prefill
    rank lost first (its own, or the sibling's with is_from_another_rank
    when the sibling noticed first), the pages are held until the room
    drained and then released.  A restarted prefill re-registers and serves
    the next request."""
    out = sched.run([ReqSpec("k1", 1501, 64, chunk=8, prefill_die=True)])
    assert out["prefill"] == [{"died": -9}, {"died": -9}]
    out["prefill"] = []
    _check_clean(sched, out)

    def lost(o, text):
        return text.startswith(f"room 1501: prefill rank {o} at 127.0.0.1:") and " lost: " in text
    _check_causes(out, "decode", "k1", 1501, "KVPeerLostError", lost)
    for rank in range(2):
        assert out["decode"][rank]["held_max"] == 1
    sched.call("start_prefill")
    out = sched.run([ReqSpec("k2", 1502, 30, chunk=8)])
    _check_clean(sched, out)
    _ok(out, "k2")


@pytest.mark.timeout(180)
def test_sglang_deferred_release_off_frees_pages_at_once(sched):
    """SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0: sglang frees a
    failed request's pages in the same pop_transferred, holding nothing; the
    causes are the same as with deferred release."""
    sched.call("start_decode", env={"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "0"})
    try:
        out = sched.run([ReqSpec("d1", 1601, 40, chunk=8, prefill_abort=True),
                         ReqSpec("d2", 1602, 12)])
        _check_clean(sched, out)
        _ok(out, "d2")
        _check_causes(out, "decode", "d1", 1601, "KVAbortedError",
                      lambda o, t: t == f"room 1601: aborted by prefill rank {o}")
        for rank in range(2):
            assert out["decode"][rank]["held_max"] == 0
    finally:
        sched.call("start_decode")


@pytest.mark.timeout(120)
def test_sglang_one_prefill_rank_aborts_every_rank_gets_the_cause(sched):
    """Only prefill rank 1 aborts: decode rank 0 and prefill rank 0, whose own
    parts succeeded, raise the origin's cause with
    is_from_another_rank=True (docs/design.md, sibling ranks)."""
    out = sched.run([ReqSpec("s1", 1701, 40, chunk=8, prefill_abort_rank=1)])
    _check_clean(sched, out)
    reason = "room 1701: aborted by prefill rank 1"
    assert out["decode"][1]["failures"] == {"1701": [["KVAbortedError", reason, False]]}
    for side in ("decode", "prefill"):
        assert out[side][0]["failures"] == {"1701": [["KVAbortedError", reason, True]]}, side


@pytest.mark.timeout(180)
def test_sglang_full_prefix_hit_through_the_decode_radix_cache(sched):
    """sglang's decode radix cache (--disaggregation-decode-enable-radix-cache)
    holds the whole prompt of h1: the decode promises decode_prefix_len =
    len(prompt) with 0 pages, the prefill calls init(0, aux) at bootstrap and
    sends a 0-page last chunk.  Every metadata row holds a stale 7 before the
    run; the decode must read the 42 the prefill wrote at the last chunk.  In
    the same batch h3's first 12 tokens are cached (18 pages move, in chunks
    of 8 tokens, after the prefix) and h2 is not cached; both decode ranks
    hold every token of each request byte for byte.  Nothing leaks: the tree
    unlocked every page it lent, and gives all of them back."""
    sched.call("start_decode", radix=True)
    try:
        specs = [ReqSpec("h1", 1801, 24, output_id=42, decode_cached=24),
                 ReqSpec("h2", 1802, 10, output_id=43),
                 ReqSpec("h3", 1803, 30, chunk=8, output_id=44, decode_cached=12)]
        out = sched.run(specs)
        _check_clean(sched, out)
        for rank, r in enumerate(out["decode"]):
            for rid, token in (("h1", 42), ("h2", 43), ("h3", 44)):
                assert r["reqs"][rid] == {"status": "ok", "output_ids": [token],
                                          "bytes_ok": True}, (rank, rid)
            assert r["pages"] == {"1801": [["send_metadata", 0, 24]],
                                  "1802": [["send_metadata", 10, 0]],
                                  "1803": [["send_metadata", 18, 12]]}, rank
            assert r["tree_protected"] == 0 and r["failures"] == {}, rank
        for rank, r in enumerate(out["prefill"]):
            assert all(r["reqs"][s.rid]["status"] == "ok" for s in specs) and r["failures"] == {}
            # h3: chunks end at 8, 16, 24, 30; the first is inside the prefix
            assert r["pages"] == {"1801": [["init", 0], ["send", 0]],
                                  "1802": [["init", 10], ["send", 10]],
                                  "1803": [["init", 18], ["send", 4], ["send", 8],
                                           ["send", 6]]}, rank
    finally:
        sched.call("start_decode")
