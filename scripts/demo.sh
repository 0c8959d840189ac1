#!/usr/bin/env bash
# Set up (if needed), build, and run the loopback demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m kvrecv demo "$@"
