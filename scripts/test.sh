#!/usr/bin/env bash
# Install what the tests need (once), then run the whole suite, real-vLLM end-to-end tests included.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/install.sh"
cd "$root"
exec "${SMALLSERVE_VENV:-$root/.venv}/bin/python" -m pytest "$@"
