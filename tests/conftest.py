"""Fixtures: a bootstrap server on a free loopback port, prefill and decode
managers in this process, prefill ranks in child processes, and the UCX
transport.  Everything a fixture creates is tracked and closed at teardown,
also when the test failed or timed out."""

from __future__ import annotations

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import kvtest  # noqa: E402
from kvtest import ROBUST_CONFIG, STD, TRANSPORTS, ChildPrefill, Side  # noqa: E402

from kvrecv import BootstrapServer, KVConfig, KVManager  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """A known environment: tcp unless a test asks for another transport, no
    KVRECV_* overrides leaking in from the caller's shell."""
    for name in list(os.environ):
        if name.startswith("KVRECV_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("UCX_TLS", TRANSPORTS["tcp"])
    yield


@pytest.fixture(params=sorted(TRANSPORTS), ids=lambda t: t)
def transport(request, monkeypatch):
    """Runs the test once per transport.  UCX_TLS is read when a manager is
    created, so this must come before any manager fixture."""
    monkeypatch.setenv("UCX_TLS", TRANSPORTS[request.param])
    return request.param


class Resources:
    """Creates and tracks servers, managers and child processes."""

    def __init__(self):
        self._servers = []
        self._managers = []
        self._children = []
        self._dealers = []

    def server(self) -> BootstrapServer:
        bs = BootstrapServer("127.0.0.1", 0)
        self._servers.append(bs)
        assert 0 < bs.port < 65536
        return bs

    def manager(self, side: Side, mode: str, bootstrap_addr=None, **config) -> KVManager:
        cfg = KVConfig(**dict(ROBUST_CONFIG, **config))
        mgr = KVManager(side.args(), mode, bootstrap_addr=bootstrap_addr, config=cfg)
        self._managers.append(mgr)
        return mgr

    def child_prefill(self, layout, rank, seed, bootstrap_addr, **kw) -> ChildPrefill:
        child = ChildPrefill(layout, rank, seed, bootstrap_addr, **kw)
        self._children.append(child)
        return child

    def dealer(self, endpoint: str, **kw) -> kvtest.Dealer:
        d = kvtest.Dealer(endpoint, **kw)
        self._dealers.append(d)
        return d

    def close(self) -> None:
        errors = []
        for group in (self._dealers, self._children, self._managers, self._servers):
            while group:
                obj = group.pop()
                try:
                    obj.close()
                except Exception as e:  # keep closing the rest
                    errors.append(repr(e))
        assert not errors, f"teardown errors: {errors}"


@pytest.fixture
def res(request):
    if "transport" in request.fixturenames:
        request.getfixturevalue("transport")  # UCX_TLS before any manager
    r = Resources()
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def bootstrap(res) -> BootstrapServer:
    return res.server()


@pytest.fixture
def pair(res, bootstrap):
    """A prefill and a decode manager (rank 0) in this process, on the
    standard layout: random source memory, canary-filled destination."""
    src = Side(STD, rank=0, seed=1234)
    dst = Side(STD, rank=0)
    prefill = res.manager(src, "prefill", bootstrap.address)
    decode = res.manager(dst, "decode")
    return types.SimpleNamespace(
        bs=bootstrap, addr=bootstrap.address, src=src, dst=dst, prefill=prefill, decode=decode
    )


def pytest_terminal_summary(terminalreporter):
    """Says why the multi-host tests (tests/test_netns.py) were skipped: they
    need root to create network namespaces."""
    reasons = set()
    for rep in terminalreporter.stats.get("skipped", []):
        if "test_netns.py" in rep.nodeid and isinstance(rep.longrepr, tuple):
            reasons.add(rep.longrepr[2])
    for r in sorted(reasons):
        terminalreporter.write_line(f"tests/test_netns.py skipped: {r}")
