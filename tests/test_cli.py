"""python -m kvrecv doctor / demo --inject, and the Prometheus metrics."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np

from kvtest import STD, wait_for

from kvrecv import KVPoll, KVReceiver, KVSender
from kvrecv.metrics import prometheus_text

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_DEMO = ["--rooms", "20", "--pages", "4", "--buffers", "4", "--item-len", "256"]


def kvrecv_cli(*args, timeout=60):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kvrecv", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


STD_ITEMS = ",".join(str(v) for v in STD.kv_item_lens)
STD_AUX = ",".join(str(v) for v in STD.aux_item_lens)


def test_doctor_live_prefill_ok(pair):
    r = kvrecv_cli("doctor", "--bootstrap", pair.addr, "--kv-item-lens", STD_ITEMS,
                   "--aux-item-lens", STD_AUX)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"\[\s*OK\] bootstrap: .*registered and reachable.*layouts match", r.stdout), r.stdout
    assert re.search(r"\[\s*OK\] manager: .*transport: ucx", r.stdout), r.stdout
    assert "doctor: ok" in r.stdout


def test_doctor_json_layout_mismatch(pair):
    r = kvrecv_cli("doctor", "--bootstrap", pair.addr, "--kv-item-lens", "64,128", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is False
    bs = [f for f in out["findings"] if f["check"] == "bootstrap"]
    assert len(bs) == 1 and bs[0]["status"] == "fail"
    assert bs[0]["detail"].startswith("LAYOUT_MISMATCH")
    assert bs[0]["fix"].startswith("layouts differ")


def test_doctor_closed_port_fails_with_bootstrap():
    addr = f"127.0.0.1:{closed_port()}"
    r = kvrecv_cli("doctor", "--bootstrap", addr, "--timeout-ms", "500")
    assert r.returncode != 0, r.stdout + r.stderr
    assert re.search(r"\[FAIL\] bootstrap: BOOTSTRAP: ", r.stdout), r.stdout
    assert f"fix: the prefill rank is not registered at {addr}" in r.stdout
    assert "doctor: FAILED" in r.stdout


def test_demo_inject_abort_requeues_and_succeeds():
    r = kvrecv_cli("demo", "--inject", "abort", *SMALL_DEMO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "requests: ok=20 failed=0" in r.stdout, r.stdout
    # every 5th request (rid % 5 == 2) is aborted once and requeued
    assert "failed attempts by code: ABORTED=4" in r.stdout, r.stdout
    assert "requeued under a new room id: 4" in r.stdout, r.stdout


def test_demo_inject_bad_layout_fails_every_request():
    r = kvrecv_cli("demo", "--inject", "bad-layout", *SMALL_DEMO)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "requests: ok=0 failed=20 (LAYOUT_MISMATCH=20)" in r.stdout, r.stdout
    assert "requeued under a new room id: 0" in r.stdout, r.stdout


def test_cli_usage():
    r = kvrecv_cli("nope")
    assert r.returncode == 2
    assert "doctor" in r.stderr


LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*)\} (\d+)$')


def parse_prometheus(text):
    samples, types = {}, {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ")
            assert typ in ("counter", "gauge")
            types[name] = typ
            continue
        m = LINE.match(line)
        assert m, f"malformed line: {line!r}"
        name, labels, value = m.groups()
        assert name in types, f"{name} has no TYPE line before it"
        lab = tuple(sorted(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels)))
        key = (name, lab)
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = int(value)
    return samples, types


def test_prometheus_text_matches_stats(pair):
    # one successful room and one aborted one, so counters are not all zero
    recv = KVReceiver(pair.decode, pair.addr, 5)
    send = KVSender(pair.prefill, pair.addr, 5)
    send.init(4, 1)
    recv.init()
    assert wait_for(recv, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    recv.send_metadata(np.arange(4, dtype=np.int32), aux_index=2)
    send.send(np.array([9, 8, 7, 6], dtype=np.int32))
    assert wait_for(recv, (KVPoll.Success, KVPoll.Failed)) == KVPoll.Success
    bad = KVReceiver(pair.decode, pair.addr, 6)
    bad.init()
    bad.abort()
    assert wait_for(bad, KVPoll.Failed) == KVPoll.Failed
    recv.clear()
    send.clear()

    mgrs = [pair.prefill, pair.decode]
    stats = {m.mode: m.stats() for m in mgrs}
    samples, types = parse_prometheus(prometheus_text(mgrs))
    assert types["kvrecv_bytes_total"] == "counter" and types["kvrecv_rooms"] == "gauge"
    for mode, st in stats.items():
        base = (("mode", mode), ("rank", "0"))

        def get(name, *extra):
            return samples[(name, tuple(sorted(base + extra)))]

        assert get("kvrecv_bytes_total") == st["bytes_moved"]
        assert get("kvrecv_rma_ops_total") == st["rma_ops_posted"]
        assert get("kvrecv_heartbeats_missed_total") == st["heartbeats_missed"]
        assert get("kvrecv_ctrl_dropped_total") == st["ctrl_dropped"]
        for state, n in st["rooms_by_state"].items():
            assert get("kvrecv_rooms", ("state", state)) == n
        for code, n in st["failures_by_code"].items():
            assert get("kvrecv_failures_total", ("code", code)) == n
    assert stats["decode"]["bytes_moved"] == STD.transfer_bytes(4, True)
    assert samples[("kvrecv_bytes_total", (("mode", "decode"), ("rank", "0")))] == STD.transfer_bytes(4, True)
    assert samples[("kvrecv_failures_total", (("code", "ABORTED"), ("mode", "decode"), ("rank", "0")))] >= 1
    # a closed manager is left out
    pair.prefill.close()
    samples, _ = parse_prometheus(prometheus_text(mgrs))
    assert all(dict(lab)["mode"] == "decode" for _, lab in samples)
