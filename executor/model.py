"""A Llama-family decoder (Llama incl. Llama-3 rope scaling, Mistral, Qwen2) running on a paged KV cache.

The parameter names are the checkpoints' own (`model.layers.3.self_attn.q_proj.weight`, ...), except that q/k/v
and gate/up are fused into one matmul each at load time (`_FUSED`). The arithmetic follows the reference
implementation's order (RMSNorm in float32, rotary tables in float32, residual adds in the model dtype), so
greedy outputs match `transformers` token for token in float32.

One forward pass serves a whole scheduler step: the tokens of every scheduled sequence back to back (prefill
chunks and decode tokens mixed), their K/V written into the paged caches, then paged attention over them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from executor.checkpoint import ModelConfig
from kernels import dispatch, pointwise

#: Checkpoint projection name -> (fused parameter, index of its slice).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass
class ForwardBatch:
    """The tensors of one step, all on the model's device. Row order: sequences back to back."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64 absolute positions
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each token's K/V
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32 KV length after this step
    logits_indices: torch.Tensor  # [L] int64 rows whose next-token logits are wanted


class Linear(nn.Linear):
    """`nn.Linear` without its random initialisation: every parameter is loaded from the checkpoint."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """`nn.Embedding` without its random initialisation (see `Linear`)."""

    def reset_parameters(self) -> None:
        pass


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add fused with the norm that follows it (in place on CPU)."""
        return pointwise.add_rms_norm(x, delta, self.weight, self.eps)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies, with Llama-3's wavelength-dependent scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    # Llama 3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(in_band, blended, scaled)


class Rotary(nn.Module):
    """cos/sin tables for every position up to the model's length; each layer looks its tokens up."""

    def __init__(self, config: ModelConfig, device: torch.device | None = None) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(config)
        positions = torch.arange(config.max_model_len, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", angles.cos().to(device), persistent=False)
        self.register_buffer("sin", angles.sin().to(device), persistent=False)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias, **factory)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False, **factory)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: Rotary,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        backend: dispatch.Backend,
        check: bool,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        key_cache, value_cache = kv_cache
        q = pointwise.rope_write_kv(
            self.qkv_proj(x),
            batch.positions,
            rotary.cos,
            rotary.sin,
            batch.slot_mapping,
            key_cache,
            value_cache,
            self.num_heads,
            backend=backend,
            check=check,
        )
        out = dispatch.paged_attention(
            q,
            key_cache,
            value_cache,
            batch.block_tables,
            batch.query_start_loc,
            batch.seq_lens,
            self.scale,
            backend=backend,
            check=check,
        )
        return self.o_proj(out.view(tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, **factory)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(pointwise.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.self_attn = Attention(config, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.mlp = MLP(config, **factory)

    def forward(self, h, delta, batch, rotary, kv_cache, backend, check) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream h and the last sublayer's output not yet added to it (None before the first
        layer), so each add is fused with the norm after it; returns them for the next layer."""
        h, x = self.input_layernorm(h, delta)
        h, x = self.post_attention_layernorm(h, self.self_attn(x, batch, rotary, kv_cache, backend, check))
        return h, self.mlp(x)


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, **factory) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)


class PagedCausalLM(nn.Module):
    """The whole model. `forward` takes one step's batch and the per-layer (K, V) caches, returns logits.

    Its parameters are allocated uninitialised on `device` in `dtype` (`load_weights` fills every one);
    the rotary tables are float32, computed not loaded."""

    def __init__(
        self, config: ModelConfig, *, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config, device=device, dtype=dtype)
        self.rotary = Rotary(config, device)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: dispatch.Backend = "auto",
    ) -> torch.Tensor:
        """Float32 logits `[len(batch.logits_indices), vocab]`; writes this step's K/V into `kv_caches`."""
        h, delta = self.model.embed_tokens(batch.input_ids), None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            h, delta = layer(h, delta, batch, self.rotary, kv_cache, backend, check=i == 0)  # check metadata once
        rows = batch.logits_indices  # only the rows that sample: the norm is per row
        _, h = self.model.norm(h[rows], None if delta is None else delta[rows])
        return self.lm_head(h).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name; every parameter must be filled exactly once."""
        params = dict(self.named_parameters(remove_duplicate=False))
        filled: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue  # some checkpoints store the rotary table; it is derived from the config here
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            target, part = name, None
            for projection, (fused, index) in _FUSED.items():
                if f".{projection}." in name:
                    target, part = name.replace(projection, fused), index
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"the checkpoint has a tensor this model does not expect: {name}")
            data = param.data
            if part is not None:
                sizes = self._fused_sizes(target)
                data = data.split(sizes, dim=0)[part]
            if tuple(data.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(data.shape)}")
            data.copy_(tensor)
            filled.add(f"{target}#{part}")
        expected = {f"{n}#{i}" for n, _ in self._slots() for i in self._parts(n)}
        missing = sorted(expected - filled)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _slots(self) -> list[tuple[str, nn.Parameter]]:
        names = dict(self.named_parameters())  # tied parameters once, under the embedding's name
        return list(names.items())

    def _parts(self, name: str) -> list[int | None]:
        if "qkv_proj" in name:
            return [0, 1, 2]
        if "gate_up_proj" in name:
            return [0, 1]
        return [None]

    def _fused_sizes(self, name: str) -> list[int]:
        c = self.config
        if "qkv_proj" in name:
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]


def build_model(
    config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], *, dtype: torch.dtype, device: torch.device
) -> PagedCausalLM:
    """Allocate on `device` in the serving dtype without random init, then load `weights` into it.

    Uninitialised parameters, not the `meta` device: a module built on `meta` still runs its initialisers
    there, and the first meta-tensor op imports `torch._dynamo` (seconds of startup, for nothing). Straight to
    the serving dtype: a float32 detour would need twice the device memory of the weights."""
    model = PagedCausalLM(config, device=device, dtype=dtype)
    model.load_weights(weights)  # copy_ casts each checkpoint tensor to the parameter's dtype
    return model.eval()
