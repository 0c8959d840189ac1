"""Build of the kvrecv._core extension against the system UCX, libzmq and
libcrypto (OpenSSL: HMAC-SHA256 of control messages)."""

import os
import shlex
import subprocess

from setuptools import Extension, setup


def pkg_config(*args):
    try:
        out = subprocess.check_output(["pkg-config", *args, "ucx", "libzmq", "libcrypto"],
                                      text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(
            "kvrecv needs UCX, libzmq and OpenSSL libcrypto development files (Debian: "
            f"apt-get install libucx-dev libzmq3-dev libssl-dev pkg-config): {exc}"
        )
    return shlex.split(out)


cflags = pkg_config("--cflags")
libs = pkg_config("--libs")
# System headers through -isystem so our warnings stay about our code.
include_dirs = [f[2:] for f in cflags if f.startswith("-I")]
extra_compile = [
    "-std=gnu11",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wshadow",
    "-Wstrict-prototypes",
    "-Wmissing-prototypes",
    "-Wformat=2",
    "-Wno-missing-field-initializers",
    "-Wno-cast-function-type",
]
for d in include_dirs:
    extra_compile += ["-isystem", d]
extra_compile += [f for f in cflags if not f.startswith("-I")]
if os.environ.get("KVRECV_WERROR"):
    extra_compile.append("-Werror")
if os.environ.get("KVRECV_SANITIZE") or os.environ.get("KVRECV_DEBUG"):
    extra_compile.append("-DKVRECV_DEBUG")  # csrc/debug.h: KVR_ASSERT checks on
if os.environ.get("KVRECV_SANITIZE"):
    san = os.environ["KVRECV_SANITIZE"]
    extra_compile += [f"-fsanitize={san}", "-fno-omit-frame-pointer", "-g", "-O1"]
    libs = libs + [f"-fsanitize={san}"]

core_sources = ["status.c", "table.c", "registry.c", "log.c", "wire.c", "auth.c", "room.c", "hist.c", "ucxaddr.c", "heap.c", "peerstate.c", "pagecopy.c",
                "ucxlog.c", "ucxtune.c", "transport.c", "tplane.c", "lane.c", "lanelisten.c", "control.c", "cuda.c", "testhook.c", "engine.c", "work.c", "peer.c",
                "sibling.c", "op.c", "stage.c", "plan.c", "stateslice.c", "group.c", "post.c", "cma.c", "readers.c", "proto_prefill.c", "proto_decode.c",
                "timer.c", "handle.c", "state.c"]
py_sources = ["module.c", "manager.c", "room.c", "bootstrap.c"]

setup(
    ext_modules=[
        Extension(
            "kvrecv._core",
            sources=[f"csrc/{s}" for s in core_sources] + [f"csrc/python/{s}" for s in py_sources],
            extra_compile_args=extra_compile,
            extra_link_args=libs + ["-pthread", "-ldl"],
        )
    ],
)
