"""Two "hosts" on one machine: a pair of network namespaces joined by a veth
pair, and kvrecv peers (tests/netns_peer.py) running inside them.

    root namespace (pytest)
      |  ip netns exec kvp<tag> python tests/netns_peer.py ...
      |  ip netns exec kvd<tag> python tests/netns_peer.py ...
    +-----------------------+            +-----------------------+
    | netns kvp<tag>        |            | netns kvd<tag>        |
    |  prefill ranks,       |   veth     |  decode ranks         |
    |  bootstrap server     |<---------->|                       |
    |  kvp<tag> 10.77.0.1   |            |  kvd<tag> 10.77.0.2   |
    +-----------------------+            +-----------------------+

Each namespace sees only its own end of the veth (and its own loopback), so
every byte between prefill and decode crosses the veth: UCX runs over tcp
with UCX_NET_DEVICES set to that end, and the control plane binds to the
veth addresses.  The link can be taken down (`ip link set ... down`) and
ports blackholed (nft, or iptables) from the root namespace with `ip -n`.

Names carry the creating process's pid and a random byte, so parallel runs
never collide; every namespace is deleted at teardown (and at interpreter
exit, should a teardown be skipped), which also removes its veth end and
kills nothing but the processes this module started in it.  Namespaces left
by a run that was killed outright are swept by the next one.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from child import JsonLineChild

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEER_SCRIPT = os.path.join(HERE, "netns_peer.py")

PREFILL_ADDR = "10.77.0.1"
DECODE_ADDR = "10.77.0.2"
PREFIX = 24

_live: List["NetPair"] = []


def _run(argv, check=True, timeout=20) -> subprocess.CompletedProcess:
    cp = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout,
                        text=True)
    if check and cp.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({cp.returncode}): {cp.stderr.strip()}")
    return cp


def unavailable_reason() -> Optional[str]:
    """Why network namespaces cannot be used here, or None if they can (a
    throw-away namespace and veth pair are created and removed to find out)."""
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    if os.geteuid() != 0:
        return f"creating network namespaces needs root (euid {os.geteuid()})"
    tag = secrets.token_hex(4)
    ns, a, b = f"kvq{tag}", f"kvqa{tag}", f"kvqb{tag}"
    try:
        cp = _run(["ip", "netns", "add", ns], check=False)
        if cp.returncode != 0:
            return f"`ip netns add` failed: {cp.stderr.strip()}"
        cp = _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b], check=False)
        if cp.returncode != 0:
            return f"cannot create a veth pair: {cp.stderr.strip()}"
        cp = _run(["ip", "link", "set", b, "netns", ns], check=False)
        if cp.returncode != 0:
            return f"cannot move a veth into a namespace: {cp.stderr.strip()}"
        return None
    finally:
        _run(["ip", "link", "del", a], check=False)
        _run(["ip", "netns", "del", ns], check=False)


def firewall_tool() -> Optional[str]:
    """"nft" or "iptables", whichever works inside a scratch namespace."""
    tag = secrets.token_hex(4)
    ns = f"kvf{tag}"
    if _run(["ip", "netns", "add", ns], check=False).returncode != 0:
        return None
    try:
        if shutil.which("nft"):
            cp = _run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", "kvtest"],
                      check=False)
            if cp.returncode == 0:
                return "nft"
        if shutil.which("iptables"):
            cp = _run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-p", "tcp",
                       "--dport", "9", "-j", "DROP"], check=False)
            if cp.returncode == 0:
                return "iptables"
        return None
    finally:
        _run(["ip", "netns", "del", ns], check=False)


_NAME = re.compile(r"^kv[pd]([0-9a-f]{6})[0-9a-f]{2}$")


def sweep_stale() -> List[str]:
    """Deletes namespaces of this module whose creating process is gone (a
    run that was SIGKILLed before its teardown).  The creator's pid is part
    of the name; namespaces of live processes are left alone."""
    removed = []
    for ns in list_namespaces():
        m = _NAME.match(ns)
        if not m:
            continue
        try:
            os.kill(int(m.group(1), 16), 0)
            continue  # its creator still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    return removed


class NetPair:
    """The prefill namespace and the decode namespace, joined by a veth."""

    def __init__(self):
        sweep_stale()
        existing = set(list_namespaces())
        while True:
            # The creator's pid (so stale ones can be swept) and a random byte.
            self.tag = f"{os.getpid() & 0xFFFFFF:06x}{secrets.token_hex(1)}"
            if not {f"kvp{self.tag}", f"kvd{self.tag}"} & existing:
                break
        self.ns = {"prefill": f"kvp{self.tag}", "decode": f"kvd{self.tag}"}
        self.dev = {"prefill": f"kvp{self.tag}", "decode": f"kvd{self.tag}"}  # <= 15 chars
        self.addr = {"prefill": PREFILL_ADDR, "decode": DECODE_ADDR}
        self.peers: List["NsPeer"] = []
        self.fw_rules: Dict[str, List[str]] = {}
        self._closed = False
        _live.append(self)
        try:
            for side in ("prefill", "decode"):
                _run(["ip", "netns", "add", self.ns[side]])
            _run(["ip", "link", "add", self.dev["prefill"], "type", "veth", "peer", "name",
                  self.dev["decode"]])
            for side in ("prefill", "decode"):
                ns, dev = self.ns[side], self.dev[side]
                _run(["ip", "link", "set", dev, "netns", ns])
                _run(["ip", "-n", ns, "addr", "add", f"{self.addr[side]}/{PREFIX}", "dev", dev])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", ns, "link", "set", dev, "up"])
            self.wait_link(True)
        except BaseException:
            self.close()
            raise

    # ---- the link -------------------------------------------------------

    def link_state(self, side: str) -> str:
        cp = _run(["ip", "-n", self.ns[side], "-o", "link", "show", self.dev[side]])
        return cp.stdout

    def set_link(self, side: str, up: bool) -> float:
        """`ip link set <veth> up|down` on one end; returns the monotonic time
        the command finished."""
        _run(["ip", "-n", self.ns[side], "link", "set", self.dev[side], "up" if up else "down"])
        return time.monotonic()

    def wait_link(self, up: bool, timeout: float = 10.0) -> None:
        """Waits until both ends report carrier (up) or not."""
        deadline = time.monotonic() + timeout
        while True:
            states = [self.link_state(s) for s in ("prefill", "decode")]
            ok = all(("LOWER_UP" in s) == up for s in states)
            if ok:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"link not {'up' if up else 'down'} after {timeout} s: {states}")
            time.sleep(0.02)

    def rate_limit(self, side: str, rate: str) -> None:
        """Shapes what `side` sends (tc tbf), e.g. "200mbit", so that big
        rooms stay in flight long enough to be cut."""
        _run(["ip", "netns", "exec", self.ns[side], "tc", "qdisc", "replace", "dev",
              self.dev[side], "root", "tbf", "rate", rate, "burst", "64kb", "latency", "500ms"])

    def ping(self, count: int = 1, timeout: int = 2) -> bool:
        if shutil.which("ping") is None:
            return True
        cp = _run(["ip", "netns", "exec", self.ns["decode"], "ping", "-c", str(count), "-W",
                   str(timeout), self.addr["prefill"]], check=False, timeout=timeout * count + 5)
        return cp.returncode == 0

    def kill_orphans(self, side: str) -> int:
        """Destroys (`ss -K`) the tcp sockets in `side` that no process owns
        any more: those a killed process left behind, whose FIN the kernel
        would otherwise retransmit once the link is back.  Returns how many."""
        other = self.addr["decode" if side == "prefill" else "prefill"]
        ns = self.ns[side]
        cp = _run(["ip", "netns", "exec", ns, "ss", "-H", "-t", "-n", "-p", "state", "all",
                   "dst", other])
        n = 0
        for line in cp.stdout.splitlines():
            cols = line.split()
            if "users:" in line or len(cols) < 5:
                continue
            local, remote = cols[3], cols[4]
            _run(["ip", "netns", "exec", ns, "ss", "-K", "-t", "-n", "src", local, "dst", remote],
                 check=False)
            n += 1
        return n

    # ---- blackholing -----------------------------------------------------

    def drop_port(self, tool: str, side: str, port: int) -> None:
        """Silently drops every tcp segment to `port` arriving at `side`."""
        ns = self.ns[side]
        if tool == "nft":
            if ns not in self.fw_rules:
                _run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", "kvtest"])
                _run(["ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "kvtest", "in",
                      "{ type filter hook input priority 0; policy accept; }"])
            _run(["ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "kvtest", "in", "tcp",
                  "dport", str(port), "drop"])
        else:
            _run(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-p", "tcp", "--dport",
                  str(port), "-j", "DROP"])
        self.fw_rules.setdefault(ns, []).append(str(port))

    def drop_data_path(self, tool: str, side: str, keep_sports) -> None:
        """Silently drops every tcp segment arriving at `side` from the other
        host unless it comes from one of keep_sports (the control and
        bootstrap ports): UCX's connections go dark, the control plane stays."""
        ns = self.ns[side]
        src = self.addr["decode" if side == "prefill" else "prefill"]
        ports = ",".join(str(p) for p in keep_sports)
        if tool == "nft":
            _run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", "kvdark"])
            _run(["ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "kvdark", "in",
                  "{ type filter hook input priority -5; policy accept; }"])
            _run(["ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "kvdark", "in", "ip",
                  "saddr", src, "tcp", "sport", "!=", "{ " + ", ".join(ports.split(",")) + " }",
                  "drop"])
        else:
            _run(["ip", "netns", "exec", ns, "iptables", "-I", "INPUT", "-s", src, "-p", "tcp",
                  "-m", "multiport", "!", "--sports", ports, "-j", "DROP"])
        self.fw_rules.setdefault(ns + "/dark", []).append(ports)

    def undrop_data_path(self, tool: str, side: str) -> None:
        ns = self.ns[side]
        src = self.addr["decode" if side == "prefill" else "prefill"]
        for ports in self.fw_rules.pop(ns + "/dark", []):
            if tool == "nft":
                _run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "kvdark"])
            else:
                _run(["ip", "netns", "exec", ns, "iptables", "-D", "INPUT", "-s", src, "-p",
                      "tcp", "-m", "multiport", "!", "--sports", ports, "-j", "DROP"])

    def undrop(self, tool: str, side: str) -> None:
        """Removes every drop rule of `side`."""
        ns = self.ns[side]
        if ns not in self.fw_rules:
            return
        if tool == "nft":
            _run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "kvtest"])
        else:
            _run(["ip", "netns", "exec", ns, "iptables", "-F", "INPUT"])
        del self.fw_rules[ns]

    def partition(self, tool: str) -> float:
        """Cuts the two hosts apart without touching the link (so UCX still
        finds its device in a process started meanwhile): each namespace
        silently drops whatever arrives from the other.  Returns the time."""
        for side, other in (("prefill", "decode"), ("decode", "prefill")):
            ns, src = self.ns[side], self.addr[other]
            if tool == "nft":
                _run(["ip", "netns", "exec", ns, "nft", "add", "table", "inet", "kvpart"])
                _run(["ip", "netns", "exec", ns, "nft", "add", "chain", "inet", "kvpart", "in",
                      "{ type filter hook input priority -10; policy accept; }"])
                _run(["ip", "netns", "exec", ns, "nft", "add", "rule", "inet", "kvpart", "in",
                      "ip", "saddr", src, "drop"])
            else:
                _run(["ip", "netns", "exec", ns, "iptables", "-I", "INPUT", "-s", src, "-j",
                      "DROP"])
        return time.monotonic()

    def heal(self, tool: str) -> float:
        """Undoes partition(); returns the time."""
        for side, other in (("prefill", "decode"), ("decode", "prefill")):
            ns, src = self.ns[side], self.addr[other]
            if tool == "nft":
                _run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "kvpart"])
            else:
                _run(["ip", "netns", "exec", ns, "iptables", "-D", "INPUT", "-s", src, "-j",
                      "DROP"])
        return time.monotonic()

    # ---- processes -------------------------------------------------------

    def spawn(self, side: str, role: str, **spec) -> "NsPeer":
        p = NsPeer(self, side, role, **spec)
        self.peers.append(p)
        return p

    def close(self) -> None:
        """Stops the peers, deletes both namespaces (and so the veth)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for p in reversed(self.peers):
            try:
                p.close()
            except Exception as e:  # keep cleaning up
                errors.append(repr(e))
        self.peers.clear()
        for side in ("prefill", "decode"):
            ns = self.ns[side]
            # Anything still running in our namespace was started by us.
            cp = _run(["ip", "netns", "pids", ns], check=False)
            for pid in cp.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)
        # A veth that never made it into a namespace lives in ours.
        for dev in self.dev.values():
            if os.path.exists(f"/sys/class/net/{dev}"):
                _run(["ip", "link", "del", dev], check=False)
        if self in _live:
            _live.remove(self)
        leftover = [ns for ns in self.ns.values() if ns in list_namespaces()]
        assert not leftover, f"namespaces left behind: {leftover}"
        assert not errors, f"errors stopping the peers: {errors}"


def list_namespaces() -> List[str]:
    cp = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]


@atexit.register
def _cleanup_at_exit() -> None:
    for pair in list(_live):
        try:
            pair.close()
        except Exception:
            pass


class NsPeer(JsonLineChild):
    """One process (tests/netns_peer.py) inside a namespace: a bootstrap
    server, or a kvrecv manager that keeps its own rooms.  Driven by JSON
    lines on stdin/stdout; kill() is a real SIGKILL."""

    def __init__(self, pair: NetPair, side: str, role: str, startup_timeout: float = 60.0,
                 **spec):
        self.pair = pair
        self.side = side
        self.role = role
        spec = dict(spec, role=role, host=pair.addr[side])
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        env["UCX_TLS"] = "tcp"
        env["UCX_NET_DEVICES"] = pair.dev[side]
        for k in [k for k in env if k.startswith("KVRECV_")]:
            del env[k]
        super().__init__(
            ["ip", "netns", "exec", pair.ns[side], sys.executable, PEER_SCRIPT, json.dumps(spec)],
            env, ROOT, f"{role} in {side} ns", startup_timeout)
        self.pid = self.proc.pid  # `ip netns exec` execs the interpreter: same pid
        self.endpoint = self.hello.get("endpoint")
        self.address = self.hello.get("address")


def failure(outcome: dict):
    """The KVTransferError a child reported for a room (unpickled: the real
    subclass), or None."""
    blob = outcome.get("exc")
    if blob is None:
        return None
    return pickle.loads(base64.b64decode(blob))
