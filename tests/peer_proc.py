"""A kvrecv manager in a child process, for tests that kill it for real."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_SCRIPT = os.path.join(HERE, "failure_peer.py")

# The child's module, loaded here too: it defines the buffers both
# processes derive, so the tests can check every byte.
import failure_peer as peer_mod  # noqa: E402


class PeerProcess:
    """One kvrecv manager (a rank) in a child process (tests/failure_peer.py),
    driven through JSON lines on its stdin/stdout, so that it can be frozen
    (SIGSTOP) and SIGKILLed for real."""

    def __init__(self, role, bootstrap, seed=1, config=None, scale=64, startup_timeout=60,
                 rank=0):
        spec = {"role": role, "bootstrap": bootstrap, "rank": rank, "seed": seed,
                "config": config or {}, "scale": scale}
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, PEER_SCRIPT, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env, cwd=ROOT,
        )
        self._buf = b""
        self._frozen = False
        self.mode = role
        self.rank = rank
        try:
            self.hello = self._read(startup_timeout)
        except BaseException:
            self.proc.kill()
            self.close()
            raise
        self.pid = self.hello["pid"]
        self.endpoint = self.hello["endpoint"]
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-2000:]

    def _read(self, timeout):
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.mode} rank {self.rank} (pid {self.proc.pid}) silent for {timeout} s; stderr:\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise AssertionError(f"{self.mode} rank {self.rank} (pid {self.proc.pid}) exited ({self.proc.wait()}); "
                                         f"stderr:\n{self.stderr()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            raise AssertionError(f"{self.mode} rank {self.rank}: command failed: {msg['error']}")
        return msg

    def call(self, op, timeout=30, **kw):
        self.proc.stdin.write((json.dumps(dict(op=op, **kw)) + "\n").encode())
        self.proc.stdin.flush()
        return self._read(timeout)

    def set_siblings(self, endpoints):
        assert self.call("set_siblings", endpoints=list(endpoints)) == {"ok": True}

    def stats(self) -> dict:
        return self.call("stats")

    def freeze(self):
        """SIGSTOP: the process keeps its sockets and memory but stops
        making progress, so whatever it had in flight stays in flight."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self._frozen = True

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time of the kill."""
        t = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        assert self.proc.returncode == -signal.SIGKILL
        return t

    def close(self):
        if self.proc.poll() is None and self._frozen:
            self.proc.kill()
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=10)
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass
        self._err.close()
