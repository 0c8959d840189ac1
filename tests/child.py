"""A test helper process driven by JSON lines on its stdin/stdout: the parent
writes one command per line and reads one answer per line.  Shared by the
failure tests' peers (peer_proc.py) and the multi-host peers (netns.py)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import tempfile
import time


class ChildError(AssertionError):
    """The child fell silent, exited, or answered a command with an error."""


class JsonLineChild:
    """Starts argv and reads its first line (the hello) within
    startup_timeout; `label` names the child in errors."""

    def __init__(self, argv, env, cwd, label: str, startup_timeout: float):
        self.label = label
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, env=env, cwd=cwd)
        self._buf = b""
        try:
            self.hello = self._read(startup_timeout)
        except BaseException:
            self.proc.kill()
            self.close()
            raise

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-3000:]

    def _read(self, timeout):
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"{self.label} (pid {self.proc.pid}) silent for {timeout} s; "
                                 f"stderr:\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise ChildError(f"{self.label} (pid {self.proc.pid}) exited "
                                     f"({self.proc.wait()}); stderr:\n{self.stderr()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg = json.loads(line)
        if isinstance(msg, dict) and "error" in msg:
            raise ChildError(f"{self.label}: command failed: {msg['error']}")
        return msg

    def post(self, op, **kw) -> None:
        """Sends a command without waiting for its answer (collect())."""
        try:
            self.proc.stdin.write((json.dumps(dict(op=op, **kw)) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise ChildError(f"{self.label} (pid {self.proc.pid}) exited ({self.proc.wait()}) "
                             f"before {op!r}; stderr:\n{self.stderr()}") from None

    def collect(self, timeout=60):
        """The answer to the command post() sent."""
        return self._read(timeout)

    def call(self, op, timeout=60, **kw):
        self.post(op, **kw)
        return self._read(timeout)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time of the kill."""
        t = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        return t

    def close(self) -> None:
        """Asks the child to exit (it closes its managers), else kills it."""
        if self.proc.poll() is None:
            try:
                self.call("exit", timeout=15)
                self.proc.wait(timeout=15)
            except Exception:
                self.proc.kill()
                self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass
        self._err.close()
