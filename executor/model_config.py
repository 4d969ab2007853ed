"""What the executor knows of a checkpoint's model, normalised across families and config spellings: the types
`executor.checkpoint` reads a config into (through `executor.models.families`) and the model code builds from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UnsupportedModel(ValueError):
    """The checkpoint is well formed but describes a model this executor does not implement."""


class CheckpointError(ValueError):
    """The checkpoint directory is missing a file or holds one that cannot be read."""


@dataclass(frozen=True)
class RopeConfig:
    """One rotary table: its base and its scaling, normalised (`rope_type` and that type's parameters)."""

    theta: float
    scaling: dict[str, Any] | None = None  # None: plain rotary


@dataclass(frozen=True)
class LayerConfig:
    """What differs between the layers of one model."""

    sliding_window: int | None = None  # keys at most this many positions back (transformers' semantics)
    rope: str = "global"  # which of ModelConfig.ropes rotates this layer's q and k
    moe: bool = False  # a sparse mixture-of-experts MLP, not the dense one


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    router: str  # "softmax_topk" (Mixtral, Qwen3-MoE) | "topk_softmax" (gpt-oss: softmax over the top-k logits)
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1 (softmax_topk only)
    router_bias: bool
    expert_bias: bool
    activation: str  # "silu" | "swiglu_oai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class ModelConfig:
    """What the executor needs to know about a decoder-only checkpoint, normalised across families and spellings.

    The defaults are the Llama family's: a model built from them is the plain pre-norm decoder."""

    architecture: str  # the family's short name: "llama", "qwen3", "gemma3", ... (executor.models.families)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # the global layers' rope (= ropes["global"]), kept for callers that read it
    rope_scaling: dict[str, Any] | None
    max_model_len: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q/k/v projections
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    model_id: str  # "{dir name}-{fingerprint}": the same files give the same id (prefix-cache key)
    layers: tuple[LayerConfig, ...] = ()  # one per layer; () means every layer LayerConfig()
    ropes: tuple[tuple[str, RopeConfig], ...] = ()  # rotary tables by name; () means global only
    output_bias: bool = False  # bias on o_proj
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary embedding (Qwen3, Gemma 3)
    norm_offset: bool = False  # RMSNorm scales by (1 + w), in float32 (Gemma)
    sandwich_norms: bool = False  # norms after attention and around the MLP as well (Gemma 2/3)
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    embed_scale: bool = False  # embeddings x sqrt(hidden), rounded to the model dtype (Gemma)
    attention_sinks: bool = False  # a learned per-head logit in every softmax (gpt-oss)
    rotary_dim: int | None = None  # dims of each head the rotary turns (partial_rotary_factor); None: all
    moe: MoEConfig | None = None

    def layer(self, index: int) -> LayerConfig:
        return self.layers[index] if self.layers else LayerConfig()

    def rope(self, name: str = "global") -> RopeConfig:
        tables = dict(self.ropes) or {"global": RopeConfig(self.rope_theta, self.rope_scaling)}
        return tables[name]

    @property
    def rope_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.ropes) or ("global",)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        return tuple(self.layer(i).sliding_window for i in range(self.num_layers))
