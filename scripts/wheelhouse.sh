#!/usr/bin/env bash
# Build a folder of wheels for an offline target machine (see deploy/wheelhouse.py and docs/install.md):
#
#   scripts/wheelhouse.sh --out wh --have target-freeze.txt [--python-version 3.12] [--split-mib 60]
#   scripts/install.sh --wheelhouse wh-parts --system-site-packages       # then, on the target, offline
#
# Downloads the CUDA build of vLLM (--vllm vllm==0.26.0) for the target's Python and platform, the part of its
# requirements that serving a text model needs (--profile full: all), and this project's dependencies, leaving
# out what the target's `pip freeze` (--have) already has and checking vLLM's pins against it. Needs pip and the
# network here; runs with the project's venv when there is one, else python3 (which then needs `packaging`).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-}
if [ -z "$python" ]; then
  if [ -x "${SMALLSERVE_VENV:-$root/.venv}/bin/python" ]; then python=${SMALLSERVE_VENV:-$root/.venv}/bin/python; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m deploy.wheelhouse build "$@"
