#!/usr/bin/env bash
# Register LLM inference servers (vLLM, SGLang, any OpenAI-compatible server) with prorl-celery.
#
#   register_llm.sh [options] URL [URL ...]
#
# Waits for the head (its address file gives the API URL and token), waits for the API, waits for
# each server to answer (GET URL/v1/models), then POSTs {"address": URL, ...} to /llm_servers
# (falling back to the drop-in /add_llm_server on an API without it). Prints "ID URL" per server.
# Registering the same URL again is harmless (the API answers 200 with the existing id).
#
# Options:
#   --head-file FILE       the head's address file (default $PRORL_HEAD_FILE, else
#                          $SLURM_SUBMIT_DIR/prorl-head.env, else ./prorl-head.env)
#   --api URL --token T    talk to this API instead of reading the head file
#   --capacity N           sequences the server runs at once (default: the service's default)
#   --protocol P           chat (OpenAI-compatible, default) or generate (token ids in and out)
#   --model NAME           model name to send (default: the first of the server's /v1/models)
#   --weight-version V     version of the weights it serves
#   --wait-llm S           seconds to wait for each server (default 1800; 0: do not wait; -1: forever)
#   --timeout S            seconds to wait for the head and the API (default 600; 0: forever)
#   --deregister ID...     remove backends by id instead (e.g. when the GPU job ends)
#
# Needs only python3's standard library (no prorl-celery on the GPU nodes); PRORL_PYTHON picks
# the interpreter. Typical use in a GPU job, after starting the server in the background:
#
#   vllm serve MODEL --port 8001 &
#   bash slurm_scripts/register_llm.sh --head-file /shared/prorl-head.env http://$(hostname):8001
#
# See llm_server.sbatch for a complete GPU job that also deregisters its servers when it ends.
set -euo pipefail
HERE=${PRORL_SLURM_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}
PYTHON=${PRORL_PYTHON:-python3}

args=()
deregister=0
have_source=0
for arg in "$@"; do
    case $arg in
        --deregister) deregister=1 ;;
        --head-file|--head-file=*|--api|--api=*) have_source=1; args+=("$arg") ;;
        *) args+=("$arg") ;;
    esac
done
if ((!have_source)) && [[ -z ${PRORL_HEAD_FILE:-} && -z ${PRORL_API_URL:-} ]]; then
    args=(--head-file "${SLURM_SUBMIT_DIR:-$PWD}/prorl-head.env" "${args[@]}")
fi
if ((deregister)); then
    exec "$PYTHON" "$HERE/prorl_slurm.py" deregister "${args[@]}"
fi
exec "$PYTHON" "$HERE/prorl_slurm.py" register "${args[@]}"
