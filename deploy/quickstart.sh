#!/usr/bin/env bash
# The one command: install what is needed (once), then run two vLLM replicas behind the gateway.
#
#   deploy/quickstart.sh                      # 2 replicas of facebook/opt-125m (tiny offline model if no network)
#   deploy/quickstart.sh --model tiny --port 9000 --replicas 3
#
# GPU machine (nvidia-smi answers): the CUDA build of vLLM, replicas share the GPU.
# Otherwise: vLLM's CPU build, the cores split between the replicas. Idempotent: the virtualenv (.venv, or
# $SMALLSERVE_VENV) is reused when it is up to date. Arguments go to `deploy up`; Ctrl-C stops everything.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${SMALLSERVE_VENV:-$root/.venv}
"$root/scripts/install.sh"
cd "$root"
replicas=()
case " $* " in *" --replicas "*|*" --plan "*) ;; *) replicas=(--replicas 2) ;; esac
echo "quickstart: starting the deployment; it prints how to call it (curl, openai) once it is ready" >&2
exec "$venv/bin/python" -m deploy.cli up ${replicas[@]+"${replicas[@]}"} "$@"
