"""What a generated model is: its options (ModelSpec), their checks, and the tokenizer's special tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = ("float32", "float16", "bfloat16")
ROPE_SCALINGS = ("none", "llama3")
BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)  # trained first, so their ids are 0..3
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte must be a token, so any text encodes
# ChatML; with tools, Hermes's (and Qwen 2.5's) format: the tools in the system turn, calls written as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results in <tool_response> turns. Without tools and
# tool messages it renders plain ChatML.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') -}}"
    "{%- for tool_call in message['tool_calls'] -%}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call -%}"
    "{%- set arguments = call['arguments'] if call['arguments'] is string else call['arguments'] | tojson -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' + arguments + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Logit std the random init aims at, so greedy decoding is numerically robust for downstream comparisons.
# Measured over 16x256 random prompts (float32, vocab 512-4096, hidden 64-512): transformers' default 0.02
# gives logit std 0.16-0.3, top-1/top-2 gaps near 0.03 and greedy text that often collapses to one token.
# initializer_range = 4/sqrt(hidden) (0.25 at 256, 0.35 at 128, 0.5 at 64) gives std 4.0, a median gap of
# 0.75-0.9, about 1 position in 1,000 with a gap under 1e-3 (1 in 2,000-4,000 under 1e-4 at hidden 64, none
# seen at hidden >= 128), and greedy continuations of mixed tokens (90-128 distinct in 128). A larger target
# barely helps the near-tie rate: the top-two gap of V Gaussians scales only like std/sqrt(2 ln V).
TARGET_LOGIT_STD = 4.0
DEFAULT_MODEL_NAME = "default-llama"


class ModelSpecError(ValueError):
    """An invalid combination of make-model options; `option` names the one to change."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@dataclass(frozen=True)
class ModelSpec:
    """Every choice that determines the files written (so also the cache key of the default model)."""

    arch: str = "llama"
    hidden_size: int = 256
    intermediate_size: int | None = None
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    head_dim: int | None = None
    vocab_size: int = 4096
    max_position: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: str = "none"
    tie_embeddings: bool | None = None
    dtype: str = "float32"
    seed: int = 0
    initializer_range: float | None = None

    @property
    def resolved_intermediate_size(self) -> int:
        # ~2.7x hidden (Llama's 8/3 ratio), rounded up to a multiple of 16
        return self.intermediate_size or 16 * math.ceil(2.7 * self.hidden_size / 16)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.heads

    @property
    def tied(self) -> bool:
        return self.tie_embeddings if self.tie_embeddings is not None else self.arch == "qwen2"

    @property
    def resolved_initializer_range(self) -> float:
        # Final-norm output has unit RMS, so logit std ~ initializer_range * sqrt(hidden): aim it at the target.
        return self.initializer_range or TARGET_LOGIT_STD / math.sqrt(self.hidden_size)

    def validate(self) -> None:
        """ModelSpecError for the first bad option, before anything is built or written."""
        if self.arch not in ARCHITECTURES:
            raise ModelSpecError("--arch", f"unknown architecture {self.arch!r}; choose {', '.join(ARCHITECTURES)}")
        for option, value in (
            ("--hidden-size", self.hidden_size),
            ("--layers", self.layers),
            ("--heads", self.heads),
            ("--kv-heads", self.kv_heads),
            ("--max-position", self.max_position),
        ):
            if value < 1:
                raise ModelSpecError(option, f"{option} must be at least 1, not {value}")
        if self.intermediate_size is not None and self.intermediate_size < 1:
            raise ModelSpecError("--intermediate-size", "--intermediate-size must be at least 1")
        if self.head_dim is None and self.hidden_size % self.heads:
            raise ModelSpecError(
                "--heads", f"{self.heads} heads do not divide --hidden-size {self.hidden_size} (or give --head-dim)"
            )
        if self.heads % self.kv_heads:
            raise ModelSpecError("--kv-heads", f"{self.kv_heads} kv heads do not divide {self.heads} heads")
        if self.resolved_head_dim < 2 or self.resolved_head_dim % 2:
            raise ModelSpecError("--head-dim", f"head dim {self.resolved_head_dim} must be even (rotary pairs)")
        from kernels.validate import SUPPORTED_HEAD_DIMS  # imports torch: not at module level (fast --help)

        if self.resolved_head_dim not in SUPPORTED_HEAD_DIMS:  # what the paged-attention kernels are built for
            raise ModelSpecError(
                "--head-dim",
                f"head dim {self.resolved_head_dim} is not one the kernels support "
                f"({', '.join(map(str, SUPPORTED_HEAD_DIMS))})",
            )
        if self.vocab_size < MIN_VOCAB:
            raise ModelSpecError(
                "--vocab-size",
                f"--vocab-size {self.vocab_size} is too small: the tokenizer "
                f"needs 256 byte tokens + {len(SPECIAL_TOKENS)} special tokens = "
                f"{MIN_VOCAB}",
            )
        if self.rope_scaling not in ROPE_SCALINGS:
            raise ModelSpecError("--rope-scaling", f"unknown rope scaling {self.rope_scaling!r}")
        if self.rope_scaling == "llama3" and self.max_position < 16:
            raise ModelSpecError("--max-position", "llama3 rope scaling needs --max-position of at least 16")
        if self.rope_theta <= 0:
            raise ModelSpecError("--rope-theta", "--rope-theta must be positive")
        if self.dtype not in DTYPES:
            raise ModelSpecError("--dtype", f"unknown dtype {self.dtype!r}; choose {', '.join(DTYPES)}")
