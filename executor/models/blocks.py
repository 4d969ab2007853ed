"""The building blocks every family is assembled from: linear layers without random init, RMSNorm (plain or
Gemma's (1 + w)), attention over the paged cache with its per-layer options, the dense MLP and the sparse MoE.

The arithmetic follows transformers' order (norms in float32, residual adds in the model dtype), so greedy outputs
match it token for token in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from executor.model_config import ModelConfig
from executor.models.rotary import Rotary, partial_rotary_order
from pagedkv_kernels import dispatch, moe, pointwise
from pagedkv_kernels import linear as cpu_linear

if TYPE_CHECKING:
    from executor.parallel import Collectives


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
    # Layer groups 1.. (executor.layer_groups): each one's slot mapping and block tables, the fields above being
    # group 0's. [G - 1, T] int64 and [G - 1, S, max_blocks] int32; G - 1 = 0 for a model of one group.
    group_slots: torch.Tensor | None = None
    group_tables: torch.Tensor | None = None

    def of_group(self, group: int) -> ForwardBatch:
        """The batch as the layers of `group` see it: their group's slots and block tables (a batch without
        group tables is every layer's: the pooling runner's, whose every layer has a cache of its own)."""
        if group == 0 or self.group_slots is None or self.group_tables is None:
            return self
        return replace(self, slot_mapping=self.group_slots[group - 1], block_tables=self.group_tables[group - 1])


class Linear(nn.Linear):
    """`nn.Linear` without its random initialisation: every parameter is loaded from the checkpoint. On the CPU
    its weight is packed for oneDNN once loaded (`prepare`; `pagedkv_kernels.linear`), and the product runs on that."""

    packed: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        pass

    def prepare(self) -> None:
        self.packed = cpu_linear.pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear.linear(x, self.weight, self.bias, self.packed)


class Embedding(nn.Embedding):
    """`nn.Embedding` without its random initialisation (see `Linear`)."""

    def reset_parameters(self) -> None:
        pass


class VocabParallelEmbedding(Embedding):
    """This rank's rows [start, start + rows) of the embedding: ids elsewhere give zeros here, and the all-reduce
    sums each token's one non-zero row."""

    def __init__(self, rows: int, dim: int, start: int, collectives: Collectives, **factory: Any) -> None:
        super().__init__(rows, dim, **factory)
        self.start = start
        self.collectives = collectives

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.collectives.all_reduce(out.masked_fill_(outside[:, None], 0))


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. `offset`: Gemma's form, x_norm * (1 + w) in float32, then cast."""

    def __init__(self, size: int, eps: float, offset: bool = False, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, **factory))
        self.eps = eps
        self.offset = offset
        self.scale: torch.Tensor | None = None  # (1 + w) in float32, once loaded (`prepare`)

    def prepare(self) -> None:
        if self.offset:
            self.scale = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add fused with the norm that follows it (in place on CPU)."""
        if not self.offset:
            return pointwise.add_rms_norm(x, delta, self.weight, self.eps)
        assert self.scale is not None, "RMSNorm.prepare() runs after the weights are loaded"
        if x.dtype == torch.float32:  # x_norm * (1 + w) in float32 is exactly the plain form with weight 1 + w
            return pointwise.add_rms_norm(x, delta, self.scale, self.eps)
        if delta is not None:
            x = x + delta
        x32 = x.float()
        return x, (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale).to(x.dtype)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)[1]


class Attention(nn.Module):
    """q/k/v in one matmul, optional per-head q/k norms, rotary + KV write, paged attention with this layer's
    window, softcap, sinks and scale."""

    def __init__(self, config: ModelConfig, index: int, **factory: Any) -> None:
        super().__init__()
        layer = config.layer(index)
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = d = config.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias, **factory)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.output_bias, **factory)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, config.norm_offset, **factory)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, config.norm_offset, **factory)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, **factory)) if config.attention_sinks else None
        self.scale = config.attention_scale if config.attention_scale is not None else d**-0.5
        self.rope = layer.rope
        # Passed only when set, so the default path calls the kernels exactly as before.
        self.options: dict[str, Any] = {}
        if layer.sliding_window is not None:
            self.options["sliding_window"] = layer.sliding_window
        if config.attn_softcap is not None:
            self.options["softcap"] = config.attn_softcap
        self.collectives: Collectives | None = None  # tensor parallel: o_proj's partial sums are all-reduced
        self.rotary_dim = config.rotary_dim

    def prepare(self) -> None:
        """Once the weights are in (before qkv_proj's own prepare: modules() visits parents first)."""
        if self.sinks is not None:
            self.options["sinks"] = self.sinks.detach().float()
        if self.rotary_dim is not None:  # partial rotary: q and k rows in the order the Rotary table turns
            assert self.q_norm is None, "per-head norms would need their weights permuted too"
            order = partial_rotary_order(self.head_dim, self.rotary_dim).to(self.qkv_proj.weight.device)
            q_heads = self.num_heads
            with torch.no_grad():
                for param in (self.qkv_proj.weight, self.qkv_proj.bias):
                    if param is None:
                        continue
                    heads = param.data[: (q_heads + self.num_kv_heads) * self.head_dim]  # q and k, not v
                    shaped = heads.view(q_heads + self.num_kv_heads, self.head_dim, *param.shape[1:])
                    shaped.copy_(shaped[:, order].clone())

    def _normed_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        assert self.q_norm is not None and self.k_norm is not None
        tokens, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split(self.split, dim=-1)
        q = self.q_norm.norm(q.reshape(-1, d)).view(tokens, -1)
        k = self.k_norm.norm(k.reshape(-1, d)).view(tokens, -1)
        return torch.cat((q, k, v), dim=-1)

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
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            qkv = self._normed_qkv(qkv)
        q = pointwise.rope_write_kv(
            qkv,
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
            **self.options,
        )
        out = self.o_proj(out.view(tokens, -1))
        return out if self.collectives is None else self.collectives.all_reduce(out)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class MLP(nn.Module):
    """gate and up in one matmul, act(gate) * up, down."""

    def __init__(self, config: ModelConfig, **factory: Any) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, **factory)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False, **factory)
        self.act = pointwise.silu_mul if config.hidden_act == "silu" else gelu_tanh_mul
        self.collectives: Collectives | None = None  # tensor parallel: down_proj's partial sums are all-reduced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        return out if self.collectives is None else self.collectives.all_reduce(out)


class SparseMoE(nn.Module):
    """A router choosing top_k of num_experts per token, the chosen experts' outputs weighted and summed.

    Expert weights are stacked: experts_gate_up [E, 2I, H] (gate rows, then up rows), experts_down [E, H, I]."""

    def __init__(self, config: ModelConfig, experts: tuple[int, int] | None = None, **factory: Any) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe = moe
        e, h, i = moe.num_experts, config.hidden_size, moe.intermediate_size
        self.gate = Linear(h, e, bias=moe.router_bias, **factory)
        if experts is not None:  # expert parallel: the router chooses among all, this rank holds these
            e = experts[1] - experts[0]
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * i, h, **factory))
        self.experts_down = nn.Parameter(torch.empty(e, h, i, **factory))
        self.experts_gate_up_bias = self.experts_down_bias = None
        if moe.expert_bias:
            self.experts_gate_up_bias = nn.Parameter(torch.empty(e, 2 * i, **factory))
            self.experts_down_bias = nn.Parameter(torch.empty(e, h, **factory))
        self.options: dict[str, Any] = {"activation": moe.activation}
        if moe.activation == "swiglu_oai":
            self.options |= {"alpha": moe.swiglu_alpha, "limit": moe.swiglu_limit}
        # Parallel: the partial outputs (experts sliced, or some experts each) are all-reduced; with expert
        # parallelism this rank holds experts [start, stop) of the router's and weighs the others' choices 0.
        self.collectives: Collectives | None = None
        self.expert_range = experts
        self.packed: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None

    def prepare(self) -> None:
        """Each expert's two weights packed for the CPU's matmuls (`pagedkv_kernels.linear`), where they pack."""
        pairs = [
            (cpu_linear.pack(gate_up), cpu_linear.pack(down))
            for gate_up, down in zip(self.experts_gate_up.detach(), self.experts_down.detach(), strict=True)
        ]
        self.packed = pairs if any(p is not None for pair in pairs for p in pair) else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k], their float32 weights [T, k]), as transformers' routers compute them."""
        logits = self.gate(x)
        if self.moe.router == "topk_softmax":
            top, ids = torch.topk(logits, self.moe.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1).float()
        probs = torch.softmax(logits.float(), dim=-1)
        top, ids = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return ids, top.to(logits.dtype).float()

    def forward(self, x: torch.Tensor, backend: dispatch.Backend) -> torch.Tensor:
        ids, weights = self.route(x)
        if self.expert_range is not None:
            start, stop = self.expert_range
            here = (ids >= start) & (ids < stop)
            ids, weights = torch.where(here, ids - start, 0), weights * here
        out = moe.experts(
            x,
            ids,
            weights,
            self.experts_gate_up,
            self.experts_down,
            b_gate_up=self.experts_gate_up_bias,
            b_down=self.experts_down_bias,
            backend=backend,
            packed=self.packed,
            **self.options,
        )
        return out if self.collectives is None else self.collectives.all_reduce(out)
