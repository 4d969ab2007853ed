"""What a generated model is: its options (ModelSpec), their checks, and the tokenizer's special tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
MOE_ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")
# Families whose config says per layer which slide (layer_types), with their default pattern: every k-th global.
LAYER_PATTERNS = {"qwen2": None, "qwen3": None, "gemma2": 2, "gemma3": 6, "gpt_oss": 2}
# Families that always slide (the window, when given, is every layer's) and those that must have one.
ALL_LAYERS_SLIDE = ("mistral", "mixtral", "phi3", "qwen3_moe")
DEFAULT_WINDOWS = {"gemma2": 4096, "gemma3": 4096, "gpt_oss": 128}
DEFAULT_THETAS = {"gemma3": 1000000.0, "gpt_oss": 150000.0}
DTYPES = ("float32", "float16", "bfloat16")
ROPE_SCALINGS = ("none", "llama3", "linear", "dynamic", "yarn", "longrope")
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
    rope_theta: float | None = None  # None: the family's (10000; Gemma 3's global layers 1e6; gpt-oss 150000)
    rope_scaling: str = "none"
    tie_embeddings: bool | None = None
    dtype: str = "float32"
    seed: int = 0
    initializer_range: float | None = None
    sliding_window: int | None = None  # None: none, or the family's own (Gemma 4096, gpt-oss 128)
    sliding_pattern: int | None = None  # every k-th layer attends globally (layer_types); None: the family's
    experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def resolved_rope_theta(self) -> float:
        return self.rope_theta or DEFAULT_THETAS.get(self.arch, 10000.0)

    @property
    def resolved_window(self) -> int | None:
        return self.sliding_window or DEFAULT_WINDOWS.get(self.arch)

    @property
    def layer_types(self) -> list[str] | None:
        """Which layers slide, for the families that say so per layer; None for the others."""
        if self.arch not in LAYER_PATTERNS:
            return None
        if self.resolved_window is None:
            return ["full_attention"] * self.layers
        pattern = self.sliding_pattern or LAYER_PATTERNS[self.arch]
        if pattern is None:  # Qwen: every layer slides unless a pattern says otherwise
            return ["sliding_attention"] * self.layers
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(self.layers)]

    @property
    def resolved_moe_intermediate_size(self) -> int:
        return self.moe_intermediate_size or 16 * math.ceil(self.resolved_intermediate_size / 32)

    @property
    def resolved_intermediate_size(self) -> int:
        # ~2.7x hidden (Llama's 8/3 ratio), rounded up to a multiple of 16
        return self.intermediate_size or 16 * math.ceil(2.7 * self.hidden_size / 16)

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.heads

    @property
    def tied(self) -> bool:
        return self.tie_embeddings if self.tie_embeddings is not None else self.arch in ("qwen2", "gemma2", "gemma3")

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
        from pagedkv_kernels.validate import SUPPORTED_HEAD_DIMS  # imports torch: not at module level (fast --help)

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
        if self.resolved_rope_theta <= 0:
            raise ModelSpecError("--rope-theta", "--rope-theta must be positive")
        if self.rope_scaling in ("yarn", "longrope") and self.max_position < 16:
            raise ModelSpecError("--max-position", f"{self.rope_scaling} rope scaling needs --max-position >= 16")
        if self.arch == "phi3" and self.rope_scaling not in ("none", "longrope"):
            raise ModelSpecError("--rope-scaling", "phi3 takes only longrope scaling")
        self._validate_windows()
        self._validate_moe()
        if self.dtype not in DTYPES:
            raise ModelSpecError("--dtype", f"unknown dtype {self.dtype!r}; choose {', '.join(DTYPES)}")

    def _validate_windows(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelSpecError("--sliding-window", "--sliding-window must be at least 1")
        if self.sliding_window is not None and self.arch == "llama":
            raise ModelSpecError("--sliding-window", "llama has no sliding window")
        if self.sliding_pattern is not None:
            if self.arch not in LAYER_PATTERNS:
                raise ModelSpecError("--sliding-pattern", f"{self.arch} slides every layer or none")
            if self.sliding_pattern < 1:
                raise ModelSpecError("--sliding-pattern", "--sliding-pattern must be at least 1")

    def _validate_moe(self) -> None:
        if self.arch not in MOE_ARCHS:
            return
        if self.experts < 1:
            raise ModelSpecError("--experts", "--experts must be at least 1")
        if not 1 <= self.experts_per_token <= self.experts:
            raise ModelSpecError(
                "--experts-per-token",
                f"--experts-per-token must be in [1, {self.experts}], not {self.experts_per_token}",
            )
        if self.decoder_sparse_step < 1:
            raise ModelSpecError("--decoder-sparse-step", "--decoder-sparse-step must be at least 1")
        if any(not 0 <= i < self.layers for i in self.mlp_only_layers):
            raise ModelSpecError("--mlp-only-layers", f"--mlp-only-layers must name layers in [0, {self.layers})")
