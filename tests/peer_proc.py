"""A kvrecv manager in a child process, for tests that kill it for real."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_SCRIPT = os.path.join(HERE, "failure_peer.py")

# The child's module, loaded here too: it defines the buffers both
# processes derive, so the tests can check every byte.
import failure_peer as peer_mod  # noqa: E402
from child import JsonLineChild  # noqa: E402
from kvrecv import KVPoll  # noqa: E402


class PeerProcess(JsonLineChild):
    """One kvrecv manager (a rank) in a child process (tests/failure_peer.py),
    driven through JSON lines on its stdin/stdout, so that it can be frozen
    (SIGSTOP) and SIGKILLed for real."""

    def __init__(self, role, bootstrap, seed=1, config=None, scale=64, startup_timeout=60,
                 rank=0, kv_path=None, heads=None, state=False, argv_prefix=()):
        # kv_path (decode): its KV buffers live in that file, which the test
        # maps too (to refill them while the child is frozen).  argv_prefix:
        # a command that runs the child (e.g. in another pid namespace).
        spec = {"role": role, "bootstrap": bootstrap, "rank": rank, "seed": seed,
                "config": config or {}, "scale": scale, "kv_path": kv_path, "heads": heads,
                "state": state}
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self._frozen = False
        self.mode = role
        self.rank = rank
        super().__init__([*argv_prefix, sys.executable, PEER_SCRIPT, json.dumps(spec)], env, ROOT,
                         f"{role} rank {rank}", startup_timeout)
        self.pid = self.hello["pid"]
        self.endpoint = self.hello["endpoint"]
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def call(self, op, timeout=30, **kw):
        return super().call(op, timeout, **kw)

    def set_siblings(self, endpoints):
        assert self.call("set_siblings", endpoints=list(endpoints)) == {"ok": True}

    def stats(self) -> dict:
        return self.call("stats")

    def wait_room(self, room, timeout=20):
        """Polls this rank's room until Success or Failed (or timeout);
        returns the last state as an int."""
        t0 = time.monotonic()
        while True:
            st = self.call("poll", room=room)["state"]
            if st in (KVPoll.Success, KVPoll.Failed) or time.monotonic() - t0 > timeout:
                return st
            time.sleep(0.005)

    def freeze(self):
        """SIGSTOP: the process keeps its sockets and memory but stops
        making progress, so whatever it had in flight stays in flight.
        Returns once every thread stopped (the signal is delivered
        asynchronously: a thread running on another core goes on for a
        moment after kill() returns)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self._frozen = True
        deadline = time.monotonic() + 5
        while not self._all_stopped():
            assert time.monotonic() < deadline, "the process did not stop within 5 s of SIGSTOP"
            time.sleep(0.0002)

    def _all_stopped(self) -> bool:
        task = f"/proc/{self.proc.pid}/task"
        try:
            for tid in os.listdir(task):
                with open(f"{task}/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
                        return False
        except FileNotFoundError:  # a thread (or the process) went meanwhile
            return False
        return True

    def thaw(self):
        """SIGCONT: a frozen process resumes where it stopped."""
        os.kill(self.proc.pid, signal.SIGCONT)
        self._frozen = False

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time of the kill."""
        t = super().kill()
        assert self.proc.returncode == -signal.SIGKILL
        return t

    def close(self):
        if self.proc.poll() is None and getattr(self, "_frozen", False):
            self.proc.kill()
            self.proc.wait(timeout=30)
        super().close()
