"""One side of a fault scenario of benchmarks/faults.py, as its own process.

    python benchmarks/faults_peer.py SYSTEM ROLE SPEC_JSON

SYSTEM is kvrecv, nixl or mooncake (faults_<system>.py holds its Target and
Initiator); ROLE is "target" (owns the destination, which it maps from the
file SPEC["dest"] so that the parent can refill and read it while this
process is frozen or dead) or "initiator" (the side that waits on its API
for the outcome of its transfers, and reports the failure).

The process prints one JSON line {"ready": {...}} once it is set up, then
obeys JSON commands on stdin and reports events as JSON lines on stdout
(libraries that write to fd 1 are moved to fd 2).  Every timestamp is
time.monotonic(), one clock for all processes of the machine.

Initiator commands: {"op": "target", "info": ...} starts streaming
transfers of SPEC["size"] bytes to that target, one after the other,
printing {"streaming": n} after the first completes and
{"failed": {"t": ..., ...what the API returned}} at the first failure;
{"op": "give_up"} abandons the transfer in flight (printing {"gave_up": t});
{"op": "replace", "info": ...} makes one transfer to a new target and
prints {"replaced": {"ok": ..., "s": ...}}.
Target commands: {"op": "abort"} (prints {"aborted": t}), {"op": "state"}
(prints {"state": {...}}, what the target's API said of its own side),
{"op": "exit"}.
"""

from __future__ import annotations

import importlib
import json
import mmap
import os
import queue
import sys
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SOURCE_BYTE = 0x5A
REPLACE_TIMEOUT_S = 30.0


def map_dest(path: str, size: int):
    """The destination: a shared mapping of a file the parent also maps."""
    import numpy as np

    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(m, dtype=np.uint8)


def source(size: int):
    import numpy as np

    return np.full(size, SOURCE_BYTE, dtype=np.uint8)


def _stdin_commands(q: queue.Queue) -> None:
    for line in sys.stdin:
        if line.strip():
            q.put(json.loads(line))
    q.put({"op": "exit"})


class Peer:
    def __init__(self, system: str, role: str, spec: dict):
        self.proto = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        self.mod = importlib.import_module(f"faults_{system}")
        self.role, self.spec = role, spec
        self.cmds: queue.Queue = queue.Queue()
        threading.Thread(target=_stdin_commands, args=(self.cmds,), daemon=True).start()

    def say(self, **obj) -> None:
        self.proto.write(json.dumps(obj) + "\n")
        self.proto.flush()

    def next_cmd(self, timeout: float):
        try:
            return self.cmds.get(timeout=timeout)
        except queue.Empty:
            return None

    def run_target(self) -> None:
        t = self.mod.Target(self.spec, map_dest(self.spec["dest"], self.spec["size"]))
        self.say(ready=t.info)
        while True:
            t.step()
            cmd = self.next_cmd(0.0005)
            if cmd is None:
                continue
            if cmd["op"] == "abort":
                t0 = time.monotonic()
                t.abort()
                self.say(aborted=t0)
            elif cmd["op"] == "state":
                self.say(state=t.state())
            elif cmd["op"] == "exit":
                t.close()
                return

    def _wait(self, ini, h, deadline):
        """Polls one transfer until it ends; a command may cut it short."""
        while True:
            r = ini.check(h)
            if r is not None:
                return r, time.monotonic()
            cmd = self.next_cmd(0) if not self.cmds.empty() else None
            if cmd is not None:
                return cmd, time.monotonic()
            if time.monotonic() > deadline:
                return None, time.monotonic()
            time.sleep(0.0002)

    def run_initiator(self) -> None:
        size = self.spec["size"]
        ini = self.mod.Initiator(self.spec, source(size))
        self.say(ready=ini.info)
        cmd = self.cmds.get()
        if cmd["op"] != "target":
            return
        ini.connect(cmd["info"])
        n = 0
        while True:
            h = ini.post(n)
            r, t = self._wait(ini, h, float("inf"))
            if r is True:
                n += 1
                if n == 1:
                    self.say(streaming=n)
                continue
            if isinstance(r, dict) and "op" in r:
                if r["op"] == "give_up":
                    ini.give_up(h)
                    self.say(gave_up=t, transfers=n)
                    break
                return
            self.say(failed=dict(r, t=t, transfers=n))
            break
        while True:
            cmd = self.cmds.get()
            if cmd["op"] != "replace":
                break
            t0 = time.monotonic()
            try:
                ini.connect(cmd["info"])
                h = ini.post(0)
                r, t = self._wait(ini, h, t0 + REPLACE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - what the caller got
                r, t = {"class": type(e).__name__, "text": str(e)[:500]}, time.monotonic()
            if r is True:
                self.say(replaced={"ok": True, "s": t - t0})
            else:
                self.say(replaced={"ok": False, "s": t - t0,
                                   "error": r if r is not None else
                                   f"no outcome within {REPLACE_TIMEOUT_S:.0f} s"})
        ini.close()


def main() -> int:
    system, role, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    p = Peer(system, role, spec)
    try:
        (p.run_target if role == "target" else p.run_initiator)()
    except Exception:  # noqa: BLE001 - the parent records it as the row's error
        p.say(error=traceback.format_exc()[-1500:])
        return 1
    finally:
        sys.stdout.flush()
    os._exit(0)  # NIXL's and Mooncake's teardown may hang or crash; nothing is left to do


if __name__ == "__main__":
    sys.exit(main())
