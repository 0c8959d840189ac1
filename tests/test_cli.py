"""python -m kvrecv doctor / demo --inject."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from kvtest import STD, refusing_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_DEMO = ["--rooms", "20", "--pages", "4", "--buffers", "4", "--item-len", "256"]


def kvrecv_cli(*args, timeout=60):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "kvrecv", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


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
    with refusing_port() as port:
        addr = f"127.0.0.1:{port}"
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


# In SMALL_DEMO (20 requests, 16 slots) the prefill holds back the first
# attempt of requests 2, 7 and 12; the injection comes when only those are
# in flight, so exactly those three fail, once each, and are requeued.


def test_demo_inject_kill_prefill_fails_in_flight_rooms_then_recovers():
    r = kvrecv_cli("demo", "--inject", "kill-prefill", *SMALL_DEMO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "injected: prefill process killed with 3 requests in flight" in r.stdout, r.stdout
    assert "injected: replacement prefill process started" in r.stdout, r.stdout
    assert "requests: ok=20 failed=0\n" in r.stdout, r.stdout
    assert "failed attempts by code: PEER_LOST=3\n" in r.stdout, r.stdout
    assert "requeued under a new room id: 3\n" in r.stdout, r.stdout
    # the decode logged the cause with the peer's name
    assert re.search(r"PEER_LOST: room 10(02|07|12): prefill rank \d at 127\.0\.0\.1:\d+ lost", r.stderr), r.stderr


def test_demo_inject_restart_prefill_fails_rooms_of_old_instance_then_recovers():
    r = kvrecv_cli("demo", "--inject", "restart-prefill", *SMALL_DEMO)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "injected: a new prefill instance registered, with 3 requests in flight on the old one" \
        in r.stdout, r.stdout
    assert "injected: old prefill process killed" in r.stdout, r.stdout
    assert "requests: ok=20 failed=0\n" in r.stdout, r.stdout
    assert "failed attempts by code: PEER_RESTARTED=3\n" in r.stdout, r.stdout
    assert "requeued under a new room id: 3\n" in r.stdout, r.stdout
    assert "restarted: the bootstrap server lists a new instance" in r.stderr, r.stderr


def test_demo_inject_restart_prefill_with_nothing_left_to_admit_is_peer_lost():
    # 5 requests all fit the first wave: no later room can notice the new
    # instance, so the old one is killed at once and its room is lost.
    r = kvrecv_cli("demo", "--inject", "restart-prefill", "--ranks", "1", "--rooms", "5",
                   *SMALL_DEMO[2:])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "injected: no request left to admit; old prefill process killed" in r.stdout, r.stdout
    assert "requests: ok=5 failed=0\n" in r.stdout, r.stdout
    assert "failed attempts by code: PEER_LOST=1\n" in r.stdout, r.stdout
    assert "requeued under a new room id: 1\n" in r.stdout, r.stdout


def test_cli_usage():
    r = kvrecv_cli("nope")
    assert r.returncode == 2
    assert "doctor" in r.stderr
