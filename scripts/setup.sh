#!/usr/bin/env bash
# Installs what kvrecv needs on a fresh Debian machine, then builds it in place.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=0
for pkg in ucx libzmq libcrypto; do
    pkg-config --exists "$pkg" 2>/dev/null || need_apt=1
done
command -v pkg-config >/dev/null 2>&1 || need_apt=1
if [ "$need_apt" = 1 ]; then
    SUDO=""
    [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
        libucx-dev libzmq3-dev libssl-dev pkg-config gcc >/dev/null
fi

# The multi-host tests (tests/test_netns.py) need iproute2 (ip, tc, ss) and nft
# or iptables.  They run only as root, so only root installs them here.
if [ "$(id -u)" = 0 ] && ! { command -v ip && command -v tc && command -v ss &&
        { command -v nft || command -v iptables; }; } >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        iproute2 nftables >/dev/null; } ||
        echo "setup: iproute2/nftables not installed: tests/test_netns.py skips what needs them"
fi

PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check setuptools wheel numpy pytest pytest-timeout \
    prometheus_client
# Editable install (the console script `kvrecv`), then the extension in place.
$PY -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . >/dev/null
$PY setup.py -q build_ext --inplace 2>&1 | grep -v -i "warn" || true
$PY -c "import kvrecv._core" 
