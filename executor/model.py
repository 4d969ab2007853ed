"""A decoder-only model of any supported family, assembled from `executor.models.blocks`, on a paged KV cache.

The parameter names are the checkpoints' own (`model.layers.3.self_attn.q_proj.weight`, ...), except that q/k/v
and gate/up are fused into one matmul each and experts are stacked into one tensor per projection at load time
(`checkpoint_slots`). One forward pass serves a whole scheduler step: the tokens of every scheduled sequence back
to back (prefill chunks and decode tokens mixed), their K/V written into the paged caches, then paged attention.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from executor.layer_groups import layer_groups
from executor.model_config import ModelConfig
from executor.models.blocks import (
    MLP,
    Attention,
    Embedding,
    ForwardBatch,
    Linear,
    RMSNorm,
    SparseMoE,
    VocabParallelEmbedding,
)
from executor.models.rotary import Rotary
from pagedkv_kernels import dispatch

if TYPE_CHECKING:
    from executor.parallel import Collectives

__all__ = ["ForwardBatch", "PagedCausalLM", "build_model"]

#: Checkpoint projection name -> (fused parameter, index of its slice).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
#: Per-expert projection (Qwen3-MoE's and Mixtral's names) -> (stacked parameter, half of gate_up or None).
_EXPERT = {
    "gate_proj": ("experts_gate_up", 0),
    "w1": ("experts_gate_up", 0),
    "up_proj": ("experts_gate_up", 1),
    "w3": ("experts_gate_up", 1),
    "down_proj": ("experts_down", None),
    "w2": ("experts_down", None),
}
_PER_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias)?$")

Part = int | tuple[int, int | None] | None  # a fused slice, an expert (and its gate/up half), or the whole


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss stores gate and up interleaved (g0 u0 g1 u1 ...); ours are halves (g0 g1 ... u0 u1 ...)."""
    index = [slice(None)] * t.dim()
    even, odd = list(index), list(index)
    even[dim], odd[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat((t[tuple(even)], t[tuple(odd)]), dim=dim)


def checkpoint_slots(name: str, tensor: torch.Tensor, arch: str) -> tuple[str, Part, torch.Tensor]:
    """(our parameter, which part of it, the tensor in our layout) for one checkpoint tensor."""
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.")
    match = _PER_EXPERT.match(name)
    if match and match.group(3) in _EXPERT:
        param, half = _EXPERT[match.group(3)]
        return f"{match.group(1)}.{param}", (int(match.group(2)), half), tensor
    match = _STACKED.match(name)
    if match:
        stem, projection, bias = match.groups()
        if arch == "gpt_oss":  # stored for x @ W ([E, H, 2I], [E, I, H]), gate/up interleaved
            if projection == "gate_up_proj":
                tensor = _deinterleave(tensor if bias else tensor.transpose(1, 2), dim=1)
            elif not bias:
                tensor = tensor.transpose(1, 2)
        param = "experts_gate_up" if projection == "gate_up_proj" else "experts_down"
        return f"{stem}.{param}{bias or ''}", None, tensor
    for projection, (fused, index) in _FUSED.items():
        if f".{projection}." in name:
            return name.replace(projection, fused), index, tensor
    return name, None, tensor


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, collectives: Collectives | None = None, **factory: Any) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset, **factory)
        self.self_attn = Attention(config, index, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset, **factory)
        self.sandwich = config.sandwich_norms
        if self.sandwich:  # Gemma: the sublayers' outputs are normed before they join the residual stream
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset, **factory)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset, **factory)
        self.mlp: MLP | SparseMoE
        if config.layer(index).moe:
            shard = collectives.shard if collectives is not None else None
            experts = shard.experts if shard is not None and shard.expert_parallel else None
            self.mlp = SparseMoE(config, experts, **factory)
        else:
            self.mlp = MLP(config, **factory)
        self.self_attn.collectives = self.mlp.collectives = collectives

    def forward(self, h, delta, batch, rotary, kv_cache, backend, check) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h and the last sublayer's output not yet added to it (None before the first
        layer), so each add is fused with the norm after it; returns them for the next layer."""
        h, x = self.input_layernorm(h, delta)
        attn = self.self_attn(x, batch, rotary, kv_cache, backend, check)
        if self.sandwich:
            h, x = self.pre_feedforward_layernorm(h, self.post_attention_layernorm.norm(attn))
            return h, self.post_feedforward_layernorm.norm(self._mlp(x, backend))
        h, x = self.post_attention_layernorm(h, attn)
        return h, self._mlp(x, backend)

    def _mlp(self, x: torch.Tensor, backend: dispatch.Backend) -> torch.Tensor:
        return self.mlp(x, backend) if isinstance(self.mlp, SparseMoE) else self.mlp(x)


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig, collectives: Collectives | None = None, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens: Embedding
        if collectives is None:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **factory)
        else:
            shard = collectives.shard
            rows, start = shard.vocab_per_rank, shard.vocab[0]
            self.embed_tokens = VocabParallelEmbedding(rows, config.hidden_size, start, collectives, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, i, collectives, **factory) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset, **factory)


class PagedCausalLM(nn.Module):
    """The whole model. `forward` takes one step's batch and the per-layer (K, V) caches, returns logits.

    Its parameters are allocated uninitialised on `device` in `dtype` (`load_weights` fills every one);
    the rotary tables are float32, computed not loaded. With `collectives` (tensor parallel), `config` is this
    rank's (`executor.parallel.local_config`) and the model holds its shard, the logits gathered whole."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        collectives: Collectives | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.collectives = collectives
        self.model = DecoderStack(config, collectives, device=device, dtype=dtype)
        # The global layers' table; Gemma 3's sliding layers have their own base (`local_rotary`).
        self.rotary = Rotary(config.rope("global"), config.head_dim, config.max_model_len, device, config.rotary_dim)
        self.local_rotary: Rotary | None = None
        if "local" in config.rope_names:
            self.local_rotary = Rotary(
                config.rope("local"), config.head_dim, config.max_model_len, device, config.rotary_dim
            )
        head_rows = config.vocab_size if collectives is None else collectives.shard.vocab_per_rank
        self.lm_head = Linear(config.hidden_size, head_rows, bias=False, device=device, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.group_of = layer_groups(config).group_of  # the block tables each layer attends through
        self.embed_scale: torch.Tensor | None = None
        if config.embed_scale:  # sqrt(hidden), rounded to the model dtype as transformers does
            self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype)

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: dispatch.Backend = "auto",
    ) -> torch.Tensor:
        """Float32 logits `[len(batch.logits_indices), vocab]`; writes this step's K/V into `kv_caches`."""
        logits = self.lm_head(self.final_hidden(batch, kv_caches, backend, batch.logits_indices))
        if self.collectives is not None:
            logits = self.collectives.gather_vocab(logits, self.config.vocab_size)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.inference_mode()
    def final_hidden(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: dispatch.Backend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The hidden states after the final norm, of `rows` (every token when None); writes K/V as `forward`."""
        h, delta = self.model.embed_tokens(batch.input_ids), None
        if self.embed_scale is not None:
            h = h * self.embed_scale
        views: dict[int, ForwardBatch] = {}
        for layer, kv_cache, group in zip(self.model.layers, kv_caches, self.group_of, strict=True):
            rotary = self.local_rotary if layer.self_attn.rope == "local" else self.rotary
            check = group not in views  # check each group's metadata once
            view = views[group] if not check else views.setdefault(group, batch.of_group(group))
            h, delta = layer(h, delta, view, rotary, kv_cache, backend, check=check)
        if rows is not None:  # only the rows wanted: the norm is per row
            h, delta = h[rows], None if delta is None else delta[rows]
        return self.model.norm(h, delta)[1]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name; every parameter must be filled exactly once."""
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: dict[str, int] = {}
        seen: set[tuple[str, str]] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue  # some checkpoints store the rotary table; it is derived from the config here
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, part, tensor = checkpoint_slots(name, tensor, self.config.architecture)
            param = params.get(target)
            if param is None:
                raise ValueError(f"the checkpoint has a tensor this model does not expect: {name}")
            if (target, repr(part)) in seen:
                raise ValueError(f"the checkpoint fills {target} twice (at {name})")
            seen.add((target, repr(part)))
            data = self._part(target, param.data, part)
            if tuple(data.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(data.shape)}")
            data.copy_(tensor)
            filled[target] = filled.get(target, 0) + data.numel()
        slots = dict(self.named_parameters())  # tied parameters once, under the embedding's name
        missing = sorted(n for n, p in slots.items() if filled.get(n, 0) != p.numel())
        if missing:
            raise ValueError(f"the checkpoint lacks or only partly fills {len(missing)} tensors, e.g. {missing[:3]}")
        for module in self.modules():
            prepare: Callable[[], None] | None = getattr(module, "prepare", None)
            if prepare is not None and module is not self:
                prepare()

    def _part(self, name: str, data: torch.Tensor, part: Part) -> torch.Tensor:
        c = self.config
        if part is None:
            return data
        if isinstance(part, tuple):
            expert, half = part
            data = data[expert]
            return data if half is None else data.chunk(2, dim=0)[half]
        if "qkv_proj" in name:
            kv = c.num_kv_heads * c.head_dim
            return data.split([c.num_heads * c.head_dim, kv, kv], dim=0)[part]
        return data.chunk(2, dim=0)[part]


def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    collectives: Collectives | None = None,
) -> PagedCausalLM:
    """Allocate on `device` in the serving dtype without random init, then load `weights` into it.

    Uninitialised parameters, not the `meta` device: a module built on `meta` still runs its initialisers
    there, and the first meta-tensor op imports `torch._dynamo` (seconds of startup, for nothing). Straight to
    the serving dtype: a float32 detour would need twice the device memory of the weights."""
    model = PagedCausalLM(config, device=device, dtype=dtype, collectives=collectives)
    model.load_weights(weights)  # copy_ casts each checkpoint tensor to the parameter's dtype
    return model.eval()
