"""python -m kvrecv doctor: checks a host before it serves.

* UCX: version and transports (``ucx_info -v`` / ``ucx_info -d``), and the
  UCX_TLS / UCX_NET_DEVICES environment.
* that a decode KVManager can be created here, and the transport it reports.
* with --bootstrap host:port: that the bootstrap server answers and the
  prefill rank is registered there, by opening a decode KVReceiver for a
  random room (it reaches WaitingForInput, or fails with the core's code and
  reason).  With --kv-item-lens (and --aux-item-lens, --page-size) the probe
  registers that layout, so a layout mismatch with the prefill is reported too.

Every finding comes with its fix; the exit status is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from typing import List, Optional

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"

FIXES = {
    "BOOTSTRAP": "the prefill rank is not registered at {addr} (or the bootstrap server does not "
                 "answer there): start the prefill instance / bootstrap server, or check the address "
                 "and that the port is reachable from this host",
    "LAYOUT_MISMATCH": "layouts differ: start both sides with the same model and KV config "
                       "(page_size, number of KV buffers, item_len per buffer, aux rows)",
    "PEER_LOST": "the prefill rank answered the bootstrap but is gone or unreachable: check that it "
                 "is alive and that its control port is reachable from this host",
    "PEER_RESTARTED": "the prefill instance was replaced while probing: run the doctor again",
    "TRANSPORT": "UCX reported an error: check UCX_TLS / UCX_NET_DEVICES (ucx_info -d lists "
                 "what is available)",
    "TIMEOUT": "no answer in time: look for a stuck prefill rank or raise --timeout-ms",
    "PROTOCOL": "the prefill speaks another wire version: run the same kvrecv version on both sides",
}


class Finding(dict):
    def __init__(self, check: str, status: str, detail: str, fix: str = ""):
        super().__init__(check=check, status=status, detail=detail, fix=fix)


def _run(cmd: List[str], timeout: float = 15.0) -> Optional[str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout + p.stderr


def check_ucx() -> List[Finding]:
    out = []
    tls = os.environ.get("UCX_TLS")
    devs = os.environ.get("UCX_NET_DEVICES")
    exe = shutil.which("ucx_info")
    transports, devices = [], []
    if exe is None:
        out.append(Finding("ucx", WARN, "ucx_info not found: UCX version and transports not listed",
                           "install UCX's tools (Debian: ucx-utils / libucx0) to list transports"))
    else:
        ver = _run([exe, "-v"]) or ""
        m = re.search(r"Version\s+(\S+)", ver)
        out.append(Finding("ucx version", OK if m else WARN,
                           f"UCX {m.group(1)}" if m else "ucx_info -v gave no version",
                           "" if m else "check the UCX installation"))
        dev = _run([exe, "-d"]) or ""
        for line in dev.splitlines():
            mt = re.match(r"#\s*Transport:\s*(\S+)", line.strip())
            md = re.match(r"#\s*Device:\s*(\S+)", line.strip())
            if mt and mt.group(1) not in transports:
                transports.append(mt.group(1))
            elif md and mt is None:
                if md.group(1) not in devices:
                    devices.append(md.group(1))
        if transports:
            out.append(Finding("ucx transports", OK, ", ".join(transports)
                               + (f"; devices: {', '.join(devices)}" if devices else "")))
        else:
            out.append(Finding("ucx transports", FAIL, "ucx_info -d lists no transport",
                               "install the UCX transport modules (e.g. libucx0, ucx-utils)"))
    out.append(Finding("UCX_TLS", INFO, f"UCX_TLS={tls}" if tls else "UCX_TLS is not set (UCX picks)",
                       "" if tls else "set UCX_TLS=tcp across hosts, posix,sysv,cma,self on one host"))
    if transports and tls:
        wanted = [t.strip() for t in tls.lstrip("^").split(",") if t.strip()]
        aliases = {"all", "sm", "shm", "mm", "rc", "ud", "dc", "rc_x", "ud_x", "dc_x", "ib",
                   "cuda", "rocm", "ugni", "tcp", "self"}
        unknown = [t for t in wanted if t not in transports and t not in aliases]
        if unknown and not tls.startswith("^"):
            out.append(Finding("UCX_TLS", WARN, f"UCX_TLS names transports ucx_info does not list: "
                               f"{', '.join(unknown)}",
                               "fix UCX_TLS to use transports from ucx_info -d"))
    net = [d for d in devices if not d.startswith(("memory", "self", "cma", "sysv", "posix"))]
    if devs:
        out.append(Finding("UCX_NET_DEVICES", INFO, f"UCX_NET_DEVICES={devs}"))
        missing = [d for d in devs.split(",") if d and d != "all" and devices and d not in devices]
        if missing:
            out.append(Finding("UCX_NET_DEVICES", FAIL,
                               f"UCX_NET_DEVICES names devices ucx_info does not list: {', '.join(missing)}",
                               f"set UCX_NET_DEVICES to one of: {', '.join(net) or 'the listed devices'}"))
    elif len([d for d in net if d != "lo"]) > 1:
        out.append(Finding("UCX_NET_DEVICES", WARN,
                           f"UCX_NET_DEVICES is not set and there are several network devices "
                           f"({', '.join(net)})",
                           "set UCX_NET_DEVICES to the NIC the peers reach (e.g. the one on the "
                           "cluster network), or UCX may pick one the peer cannot reach"))
    else:
        out.append(Finding("UCX_NET_DEVICES", INFO, "UCX_NET_DEVICES is not set"))
    return out


def check_gpu() -> List[Finding]:
    """CUDA runtime (dlopen'ed: KVRECV_CUDART, libcudart.so.12, libcudart.so),
    GPU count, UCX's memory types, and the path device buffers would take."""
    from . import _core

    out = []
    info = _core.cuda_info()
    if info["loaded"]:
        v = info["runtime_version"]
        out.append(Finding("cuda runtime", OK, f"{info['path']} (runtime {v // 1000}.{v % 1000 // 10}), "
                           f"{info['devices']} GPU(s)"))
    else:
        out.append(Finding("cuda runtime", INFO, f"not loaded: {info['error']}",
                           "only needed for GPU buffers: install the CUDA runtime or set "
                           "KVRECV_CUDART to libcudart.so"))
    try:
        names, cuda = _core.ucx_memory_types()
        out.append(Finding("ucx memory types", OK, names))
    except RuntimeError as e:
        names, cuda = "", False
        out.append(Finding("ucx memory types", FAIL, str(e), "check the UCX installation"))
    if not info["loaded"] or info["devices"] < 1:
        path, why = "host", "no usable CUDA runtime/GPU: device buffers cannot be used"
    elif cuda:
        path, why = "ucx-cuda", "UCX moves cuda memory itself (KVConfig.force_staging=True stages instead)"
    else:
        path, why = "staged", ("this UCX has no cuda memory support: device buffers go through pinned "
                               "host slots (KVConfig staging_slots / staging_slot_bytes)")
    out.append(Finding("gpu path", INFO, f"{path}: {why}",
                       "" if path != "staged" else "a UCX built with CUDA (UCX_HOME, or the libucx "
                       "wheels) moves VRAM directly"))
    return out


def _probe_buffers(kv_item_lens, aux_item_lens, pages=4, rows=4):
    import numpy as np

    kv = [np.zeros(pages * n, dtype=np.uint8) for n in kv_item_lens]
    aux = [np.zeros(rows * n, dtype=np.uint8) for n in aux_item_lens]
    return kv, aux


def check_manager(opts) -> (List[Finding], object):
    from ._api import KVArgs, KVConfig, KVManager

    kv, aux = _probe_buffers(opts.kv_item_lens, opts.aux_item_lens)
    try:
        args = KVArgs.from_buffers(opts.rank, kv, opts.kv_item_lens, aux, opts.aux_item_lens,
                                   page_size=opts.page_size)
        mgr = KVManager(args, "decode", host=opts.host,
                        config=KVConfig(bootstrap_timeout_ms=opts.timeout_ms))
    except Exception as e:  # noqa: BLE001 - any failure is the finding
        return [Finding("manager", FAIL, f"a decode KVManager cannot be created: {e}",
                        "check UCX_TLS / UCX_NET_DEVICES (ucx_info -d lists what is available) "
                        "and --host")], None
    return [Finding("manager", OK, f"decode KVManager created; transport: {mgr.transport}; "
                    f"control endpoint {mgr.endpoint}")], mgr


def check_bootstrap(opts, mgr) -> List[Finding]:
    from ._api import KVPoll, KVReceiver
    from ._core import KVTransferError

    addr = opts.bootstrap
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return [Finding("bootstrap", FAIL, f"--bootstrap {addr!r} is not host:port",
                        "pass the prefill's bootstrap address as host:port")]
    room = random.getrandbits(62) | (1 << 62)
    recv = KVReceiver(mgr, addr, room)
    try:
        recv.init(0)
        deadline = time.monotonic() + opts.timeout_ms / 1000 + 5
        state = recv.poll()
        while state == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.002)
            state = recv.poll()
        if state == KVPoll.WaitingForInput:
            layout = ("layouts match" if opts.layout_given else
                      "layout not compared (pass --kv-item-lens/--aux-item-lens/--page-size)")
            return [Finding("bootstrap", OK, f"{addr} answers; prefill rank {opts.rank} is "
                            f"registered and reachable (room reached WaitingForInput); {layout}")]
        if state != KVPoll.Failed:
            return [Finding("bootstrap", FAIL,
                            f"no answer from {addr} within {opts.timeout_ms} ms (state {state.name})",
                            FIXES["TIMEOUT"])]
        try:
            recv.failure_exception()
        except KVTransferError as e:
            code, reason = e.code, e.failure_reason
        if code == "LAYOUT_MISMATCH" and not opts.layout_given:
            return [Finding("bootstrap", OK, f"{addr} answers; prefill rank {opts.rank} is "
                            f"registered and reachable; layout not compared (the probe's layout is "
                            f"not the serving one: {reason}); pass --kv-item-lens/--aux-item-lens/"
                            f"--page-size to compare it")]
        fix = FIXES.get(code, "see the reason").format(addr=addr)
        return [Finding("bootstrap", FAIL, f"{code}: {reason}", fix)]
    finally:
        recv.abort()
        recv.clear()


def _ints(text: str) -> List[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be > 0")
    return vals


def run(argv=None) -> int:
    p = argparse.ArgumentParser(prog="kvrecv doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bootstrap", metavar="HOST:PORT", help="probe this bootstrap server")
    p.add_argument("--rank", type=int, default=0, help="the rank to probe (decode rank r is served "
                   "by prefill rank r)")
    p.add_argument("--host", default="127.0.0.1", help="this host's control address")
    p.add_argument("--kv-item-lens", type=_ints, default=None,
                   help="comma list: bytes per page of each KV buffer, as the serving decode registers")
    p.add_argument("--aux-item-lens", type=_ints, default=None, help="comma list: aux row lengths")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--timeout-ms", type=int, default=3000, help="bootstrap timeout of the probe")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    opts = p.parse_args(argv)
    import logging

    # the probe's own abort is logged by the core; keep the report readable
    logging.getLogger("kvrecv").setLevel(logging.ERROR)
    opts.layout_given = opts.kv_item_lens is not None
    if opts.kv_item_lens is None:
        opts.kv_item_lens = [64]
    if opts.aux_item_lens is None:
        opts.aux_item_lens = []

    findings = check_ucx()
    findings += check_gpu()
    found, mgr = check_manager(opts)
    findings += found
    if opts.bootstrap:
        if mgr is None:
            findings.append(Finding("bootstrap", FAIL, "not probed: no manager",
                                    "fix the manager check first"))
        else:
            findings += check_bootstrap(opts, mgr)
    else:
        findings.append(Finding("bootstrap", INFO, "not probed",
                                "pass --bootstrap host:port to check a prefill's bootstrap server"))
    if mgr is not None:
        mgr.close()
    failed = any(f["status"] == FAIL for f in findings)
    if opts.json:
        print(json.dumps({"ok": not failed, "findings": findings}, indent=2))
    else:
        for f in findings:
            print(f"[{f['status'].upper():>4}] {f['check']}: {f['detail']}")
            if f["fix"] and f["status"] in (FAIL, WARN):
                print(f"       fix: {f['fix']}")
        print("doctor: " + ("FAILED" if failed else "ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
