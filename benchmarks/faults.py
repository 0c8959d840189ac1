"""Faults side by side: kvrecv, NIXL and Mooncake under the same failures.

    python benchmarks/faults.py [--quick] [--systems kvrecv,nixl,mooncake]
    python benchmarks/faults.py --report-only     # table, figure, README block
    python -m kvrecv bench faults [...]

For each system, transport (tcp; shared memory where the system can run on
it), payload size and scenario, two processes on 127.0.0.1
(benchmarks/faults_peer.py): an initiator that streams transfers of the
payload to a target, one after the other, and waits on its API for each.
Mid-stream, the harness injects the fault:

  kill       SIGKILL of the target
  freeze     SIGSTOP of the target; SIGCONT once the initiator reported the
             failure, or gave up after CAP_S seconds without one
  restart    SIGKILL of the target and a new one on the same address
             (kvrecv: ctrl port; Mooncake: rpc port; NIXL: agent name)
  link_down  the target in its own network namespace, its veth end taken
             down (root only; tcp only: no shared-memory byte crosses a link)
  abort      the target gives the transfer up (kvrecv: KVReceiver.abort();
             NIXL and Mooncake have no receiver-side cancel: the target
             withdraws its memory registration)

Recorded: seconds from the fault to the initiator's API reporting a failure;
what the caller received (exception class or status, its text, whether the
text names the cause and the peer); late bytes: the destination (a file
mapping the harness shares with the target) is refilled with a pattern when
the failure is reported, the frozen target resumed (the link brought up),
and 2 s later every byte that differs from the pattern is counted; then
whether the same initiator process moves a transfer to a replacement target
(its bytes checked).  Results: benchmarks/results/faults.json, faults.png,
and the table between the faults-table markers of README.md.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402
import faults_report as R  # noqa: E402
from run import env_for  # noqa: E402

SYSTEMS = ("kvrecv", "nixl", "mooncake")
SCENARIOS = ("kill", "freeze", "restart", "link_down", "abort")
SIZES = (4 * C.KiB, 64 * C.MiB)
CAP_S = 45.0
LATE_WAIT_S = 2.0
PATTERN = 0xEE
START_TIMEOUT_S = 60.0


def log(msg):
    print(msg, flush=True)


class Proc:
    """A faults_peer.py process: JSON lines in and out, stderr to a file."""

    def __init__(self, system, role, spec, env, tmp, prefix=()):
        self.err_path = os.path.join(tmp, f"{system}.{role}.{time.monotonic_ns()}.err")
        self.err = open(self.err_path, "w")
        self.p = subprocess.Popen([*prefix, sys.executable, os.path.join(HERE, "faults_peer.py"),
                                   system, role, json.dumps(spec)], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.err)
        os.set_blocking(self.p.stdout.fileno(), False)
        self.buf = ""

    def send(self, **obj):
        try:
            self.p.stdin.write((json.dumps(obj) + "\n").encode())
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def event(self, keys, timeout):
        """The next line holding one of keys, as (key, value, time seen);
        (None, None, t) at the timeout or when the process ended."""
        deadline = time.monotonic() + timeout
        while True:
            while "\n" in self.buf:
                line, self.buf = self.buf.split("\n", 1)
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                for k in keys + ("error",):
                    if k in obj:
                        return k, obj[k], time.monotonic()
            try:
                chunk = os.read(self.p.stdout.fileno(), 1 << 16)
            except BlockingIOError:
                chunk = None
            if chunk:
                self.buf += chunk.decode(errors="replace")
                continue
            if time.monotonic() > deadline or chunk == b"":
                return None, None, time.monotonic()
            time.sleep(0.001)

    def log_lines(self, n=2):
        """The last error lines the process logged (UCX, glog, Python)."""
        self.err.flush()
        with open(self.err_path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ("rror" in ln or ln.startswith("E"))
                     and "NIXL INFO" not in ln]
        return [ln[:300] for ln in lines[-n:]]

    def signal(self, sig):
        try:
            os.kill(self.p.pid, sig)
        except ProcessLookupError:
            pass

    def close(self):
        self.send(op="exit")
        self.signal(signal.SIGCONT)
        try:
            self.p.wait(5)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.err.close()


def last_line(x):
    """A process's error as one line: the last line of its traceback."""
    lines = [ln for ln in str(x).splitlines() if ln.strip()]
    return lines[-1] if lines else str(x)


class Dest:
    """A destination region: a file the target maps and the harness reads."""

    def __init__(self, tmp, size):
        self.path = os.path.join(tmp, f"dest.{time.monotonic_ns()}")
        with open(self.path, "wb") as f:
            f.truncate(size)
        fd = os.open(self.path, os.O_RDWR)
        self.m = mmap.mmap(fd, size, mmap.MAP_SHARED)
        os.close(fd)
        import numpy as np

        self.a = np.frombuffer(self.m, dtype=np.uint8)

    def refill(self):
        self.a[:] = PATTERN

    def differing(self, byte=PATTERN):
        return int((self.a != byte).sum())


class Case:
    """One (system, transport, size, scenario): the processes and the fault."""

    def __init__(self, a, system, label, tls, size, scenario, tmp, net):
        self.a, self.system, self.label, self.size = a, system, label, size
        self.scenario, self.tmp, self.net = scenario, tmp, net
        extra = {"UCX_NET_DEVICES": net.dev["decode"]} if net else {}
        self.env = env_for(tls, extra)
        if net:
            self.env_i = env_for(tls, {"UCX_NET_DEVICES": net.dev["prefill"]})
        else:
            self.env_i = self.env
        self.procs = []
        self.row = {"system": system, "transport": label, "size": size, "scenario": scenario}

    def spec(self, side, **kw):
        host = self.net.addr[side] if self.net else "127.0.0.1"
        proto = "tcp" if self.label == "tcp" else "shm"
        return dict(kw, size=self.size, host=host, mooncake_protocol=proto)

    def prefix(self, side):
        return ("ip", "netns", "exec", self.net.ns[side]) if self.net else ()

    def start_target(self, ini_info, room0, port=0):
        dest = Dest(self.tmp, self.size)
        spec = self.spec("decode", dest=dest.path, peer=ini_info, room0=room0, port=port)
        t = Proc(self.system, "target", spec, self.env, self.tmp, self.prefix("decode"))
        self.procs.append(t)
        k, info, _ = t.event(("ready",), START_TIMEOUT_S)
        if k != "ready":
            raise RuntimeError(f"the target did not start: {last_line(info or t.log_lines(1))}")
        return t, dest, info

    def run(self):
        ini = Proc(self.system, "initiator", self.spec("prefill"), self.env_i, self.tmp,
                   self.prefix("prefill"))
        self.procs.append(ini)
        k, ini_info, _ = ini.event(("ready",), START_TIMEOUT_S)
        if k != "ready":
            raise RuntimeError(
                f"the initiator did not start: {last_line(ini_info or ini.log_lines(1))}")
        tgt, dest, tinfo = self.start_target(ini_info, 0)
        ini.send(op="target", info=tinfo)
        k, v, _ = ini.event(("streaming", "failed"), 30)
        if k != "streaming":
            raise RuntimeError(
                f"no transfer completed before the fault: {last_line(v or ini.log_lines(1))}")
        time.sleep(0.05 if self.size < C.MiB else 0.2)
        replacement = self.inject(ini_info, tgt, tinfo)
        # after a restart, bytes of the old stream landing in the new instance are late
        self.outcome(ini, tgt, replacement[1] if replacement else dest, tinfo)
        self.replace(ini, ini_info, replacement)
        return self.row

    def inject(self, ini_info, tgt, tinfo):
        """The fault; returns the target that stands in for the old one
        when it comes back on the same address (restart), else None."""
        self.t_fault = time.monotonic()
        if self.scenario in ("kill", "restart"):
            tgt.signal(signal.SIGKILL)
        elif self.scenario == "freeze":
            tgt.signal(signal.SIGSTOP)
        elif self.scenario == "link_down":
            self.t_fault = self.net.set_link("decode", False)
        elif self.scenario == "abort":
            tgt.send(op="abort")
            k, t, _ = tgt.event(("aborted",), 10)
            self.t_fault = t if k == "aborted" else self.t_fault
        if self.scenario == "restart":
            tgt.p.wait()
            self.restarted = self.start_target(ini_info, 1_000_000, tinfo.get("port", 0))
            self.row["restart_s"] = time.monotonic() - self.t_fault
            return self.restarted
        return None

    def outcome(self, ini, tgt, dest, tinfo):
        k, v, _ = ini.event(("failed",), max(0.0, self.t_fault + self.a.cap - time.monotonic()))
        r = self.row
        if k == "failed":
            dest.refill()
            r["detect_s"] = v["t"] - self.t_fault
            r["what"] = {x: v.get(x) for x in ("class", "code", "text", "peer")}
            text = " ".join(str(v.get(x) or "") for x in ("text", "peer"))
            r["names_peer"] = R.named(text, tinfo.get("names", []))
            r["names_cause"] = R.named(text, R.CAUSE_WORDS[self.scenario])
        else:
            r["detect_s"] = None
            r["error"] = v if k == "error" else None
            ini.send(op="give_up")
            ini.event(("gave_up",), 10)
            dest.refill()
        r["log"] = ini.log_lines()
        if self.scenario == "freeze":
            tgt.signal(signal.SIGCONT)
        if self.scenario == "link_down":
            self.net.set_link("decode", True)
        time.sleep(LATE_WAIT_S)
        r["late_bytes"] = dest.differing()
        r["late_bytes_source"] = self.size - dest.differing(0x5A)  # of them, source bytes
        if self.scenario not in ("kill", "restart"):
            tgt.send(op="state")
            k, v, t = tgt.event(("state",), 5)
            if k == "state" and v:
                r["target_state"] = dict(v, t_failure_reported=self.t_fault + (r["detect_s"] or 0))

    def replace(self, ini, ini_info, replacement):
        if self.scenario == "link_down":
            self.net.wait_link(True)
        t, dest, info = replacement or self.start_target(ini_info, 2_000_000)
        ini.send(op="replace", info=info)
        k, v, _ = ini.event(("replaced",), 45)
        ok = k == "replaced" and v["ok"]
        bad = dest.differing(0x5A) if ok else None
        self.row["next_ok"] = bool(ok and bad == 0)
        self.row["next"] = v if k == "replaced" else {"error": v or "no answer within 45 s"}
        if ok and bad:
            self.row["next"]["bad_bytes"] = bad

    def close(self):
        for p in self.procs:
            p.close()


def why_not(system, label, scenario, net_reason):
    """Why a case cannot run here (the row keeps it), or None."""
    if scenario == "link_down":
        if label != "tcp":
            return "not run: over shared memory no data byte crosses a network link"
        if net_reason:
            return f"not run: {net_reason}"
    return None


def run_case(a, system, label, size, scenario, tmp, net_reason):
    tls = C.TRANSPORTS[label]
    reason = why_not(system, label, scenario, net_reason)
    row = {"system": system, "transport": label, "size": size, "scenario": scenario}
    if reason:
        row["status"] = reason
        return row
    net = None
    case = None
    try:
        if scenario == "link_down":
            from netns import NetPair

            net = NetPair()
        case = Case(a, system, label, tls, size, scenario, tmp, net)
        row = case.run()
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - the row says what went wrong
        row = dict(case.row if case else row, status="error",
                   error=f"{type(e).__name__}: {str(e)[:600]}")
    finally:
        if case:
            case.close()
        if net:
            net.close()
    return row


def net_unavailable():
    sys.path.insert(0, os.path.join(C.ROOT, "tests"))
    try:
        from netns import unavailable_reason

        return unavailable_reason()
    except Exception as e:  # noqa: BLE001
        return f"network namespaces unavailable: {type(e).__name__}: {e}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 KiB only, tcp only, cap 10 s")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--only", choices=["tcp", "shm"])
    ap.add_argument("--out", default=R.RESULTS)
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the figure and the README table from --out")
    a = ap.parse_args(argv)
    if a.report_only:
        R.report(a.out)
        return 0
    a.cap = 10.0 if a.quick else CAP_S
    sizes = SIZES[:1] if a.quick else SIZES
    labels = [a.only] if a.only else (["tcp"] if a.quick else ["tcp", "shm"])
    systems = [s for s in a.systems.split(",") if s]
    avail = {s: R.peer_available(s) for s in systems}
    for s, why in avail.items():
        if why:
            log(f"{s}: cannot run: {why}")
    net_reason = net_unavailable()
    res = {"cap_s": a.cap, "late_wait_s": LATE_WAIT_S, "sizes": list(sizes), "quick": a.quick,
           "machine": R.machine(), "versions": R.versions(), "rows": []}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvrecv-faults-", dir="/dev/shm") as tmp:
        for label in labels:
            for scenario in [s for s in a.scenarios.split(",") if s]:
                for size in sizes:
                    for system in systems:
                        if avail[system]:
                            row = {"system": system, "transport": label, "size": size,
                                   "scenario": scenario, "status": f"not run: {avail[system]}"}
                        else:
                            row = run_case(a, system, label, size, scenario, tmp, net_reason)
                        res["rows"].append(row)
                        log(R.row_line(row, a.cap))
                        res["wall_s"] = time.monotonic() - t0
                        C.dump(a.out, res)
    res["loadavg_end"] = os.getloadavg()
    C.dump(a.out, res)
    R.report(a.out)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
