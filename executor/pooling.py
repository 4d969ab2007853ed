"""Embeddings: a checkpoint served as an embedding model (`--task embed`). Prompts go through one prefill-only
forward pass each batch; the hidden states after the final norm are pooled per prompt (last token, mean or the
first (CLS) token), optionally truncated to fewer dimensions (Matryoshka) and L2-normalised.

The pass is a plain no-cache one on a scratch cache of this module's own, never the pool blockd allocates; why
the prefix cache cannot serve it is told in docs/architecture.md ("Embeddings").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch

from executor.model import ForwardBatch, PagedCausalLM
from executor.model_config import ModelConfig
from executor.runner import zeroed_tensors
from pagedkv_kernels import dispatch

MAX_PROMPTS_ROUNDED = 64


class PoolingType(StrEnum):
    LAST = "last"  # the last token's state: decoder embedding models (Qwen3-Embedding, e5-mistral)
    MEAN = "mean"  # the mean over every token of the prompt
    CLS = "cls"  # the first token's state


#: vLLM's `--pooling-type` spellings and sentence-transformers' 1_Pooling flags, onto ours.
_SPELLINGS = {"last": PoolingType.LAST, "lasttoken": PoolingType.LAST, "mean": PoolingType.MEAN, "cls": PoolingType.CLS}
_ST_FLAGS = {
    "pooling_mode_lasttoken": PoolingType.LAST,
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
}


class PoolingConfigError(ValueError):
    pass


def pooling_type(name: str) -> PoolingType:
    try:
        return _SPELLINGS[name.strip().lower().replace("_", "")]
    except KeyError:
        raise PoolingConfigError(f"unknown pooling type {name!r}: use last, mean or cls") from None


@dataclass(frozen=True)
class PoolingConfig:
    """How a checkpoint's embeddings are made."""

    type: PoolingType = PoolingType.LAST
    normalize: bool = True  # L2 norm 1 unless a request says otherwise
    matryoshka: bool = False  # truncating to fewer dimensions keeps the meaning (trained so)
    matryoshka_dimensions: tuple[int, ...] | None = None  # the sizes it was trained for, when the config names them


def read_pooling_config(
    model_dir: Path | None, pooling: str | None = None, allow_any_dimensions: bool = False
) -> PoolingConfig:
    """The checkpoint's pooling: `pooling` (`--pooling-type`) if given, else its sentence-transformers config
    (`modules.json` naming a Pooling module and, if present, a Normalize one), else last-token and normalised
    (decoder embedding models). Matryoshka support from config.json's `is_matryoshka` / `matryoshka_dimensions`
    (vLLM's keys), or everywhere with `allow_any_dimensions`."""
    kind = PoolingType.LAST if pooling is None else pooling_type(pooling)
    normalize = True
    raw: object = {}
    if model_dir is not None:
        modules = _json(model_dir / "modules.json")
        if isinstance(modules, list):
            modules = [m for m in modules if isinstance(m, dict)]
            normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
            for module in modules:
                if pooling is None and str(module.get("type", "")).endswith("Pooling"):
                    kind = _sentence_transformers_pooling(model_dir / str(module.get("path", "")) / "config.json")
        raw = _json(model_dir / "config.json") or {}
    raw = raw if isinstance(raw, dict) else {}
    dims = raw.get("matryoshka_dimensions")
    sizes = tuple(d for d in dims if isinstance(d, int) and d > 0) if isinstance(dims, list) else ()
    dimensions = sizes or None
    matryoshka = allow_any_dimensions or bool(raw.get("is_matryoshka")) or dimensions is not None
    return PoolingConfig(kind, normalize, matryoshka, None if allow_any_dimensions else dimensions)


def _sentence_transformers_pooling(path: Path) -> PoolingType:
    config = _json(path)
    if not isinstance(config, dict):
        raise PoolingConfigError(f"{path}: the Pooling module's config is missing or not a JSON object")
    asked = [flag for flag, on in config.items() if flag.startswith("pooling_mode") and on]
    if len(asked) != 1 or asked[0] not in _ST_FLAGS:
        raise PoolingConfigError(
            f"{path}: pagedkv pools by exactly one of {', '.join(_ST_FLAGS)}; this config asks for "
            f"{', '.join(asked) or 'none'} (--pooling-type overrides it)"
        )
    return _ST_FLAGS[asked[0]]


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise PoolingConfigError(f"{path}: {exc}") from None


def pool(hidden: torch.Tensor, lengths: list[int], kind: PoolingType) -> torch.Tensor:
    """One row per prompt from `hidden` ([sum(lengths), H], prompts back to back), in float32."""
    hidden = hidden.float()
    ends = torch.tensor(lengths, device=hidden.device).cumsum(0)
    if kind is PoolingType.LAST:
        return hidden[ends - 1]
    if kind is PoolingType.CLS:
        return hidden[ends - torch.tensor(lengths, device=hidden.device)]
    return torch.stack([part.mean(0) for part in hidden.split(lengths)])


def finish(vectors: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation first, then the L2 norm (so a truncated vector has norm 1 again)."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
    return vectors


class Embedder:
    """Pooled embeddings of prompts, in batches that fit its scratch KV cache."""

    def __init__(
        self,
        model: PagedCausalLM,
        config: ModelConfig,
        pooling: PoolingConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        max_batch_tokens: int,
        backend: dispatch.Backend = "auto",
    ) -> None:
        self.model = model
        self.config = config
        self.pooling = pooling
        self.device = device
        self.block_size = block_size
        self.backend = backend
        # A batch holds prompts up to max_batch_tokens in all, or one prompt of up to the context alone.
        self.max_batch_tokens = max(max_batch_tokens, config.max_model_len)
        # Each prompt rounds its last block up: room for MAX_PROMPTS_ROUNDED such blocks; a batch of more short
        # prompts than that is split where the blocks run out.
        blocks = -(-self.max_batch_tokens // block_size) + MAX_PROMPTS_ROUNDED
        shape = (blocks, block_size, config.num_kv_heads, config.head_dim)
        caches = zeroed_tensors(2 * config.num_layers, shape, dtype, device)
        self.kv_caches = [(caches[2 * i], caches[2 * i + 1]) for i in range(config.num_layers)]
        self.num_blocks = blocks

    def batches(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """The prompts in order, cut into the batches one pass each takes (`run`)."""
        out: list[list[list[int]]] = [[]]
        tokens = blocks = 0
        for prompt in prompts:
            need = -(-len(prompt) // self.block_size)
            if out[-1] and (tokens + len(prompt) > self.max_batch_tokens or blocks + need > self.num_blocks):
                out.append([])
                tokens = blocks = 0
            out[-1].append(prompt)
            tokens += len(prompt)
            blocks += need
        return out if out[-1] else []

    def embed(self, prompts: list[list[int]], dimensions: int | None, normalize: bool) -> torch.Tensor:
        """Float32 `[len(prompts), dimensions or hidden]`, row i prompt i's embedding."""
        pooled = torch.cat([self.run(batch) for batch in self.batches(prompts)])
        return finish(pooled, dimensions, normalize)

    def run(self, prompts: list[list[int]]) -> torch.Tensor:
        """One pass: the pooled (not yet truncated or normalised) float32 states of a batch that fits."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        starts = [0]
        first = 0  # each prompt's own blocks of the scratch cache, one after another
        for prompt in prompts:
            n = len(prompt)
            table = list(range(first, first + -(-n // bs)))
            first += len(table)
            ids += prompt
            positions += range(n)
            slots += (table[p // bs] * bs + p % bs for p in range(n))
            tables.append(table)
            starts.append(starts[-1] + n)
        width = max(len(t) for t in tables)
        device = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device),
            logits_indices=torch.empty(0, dtype=torch.int64, device=device),
        )
        hidden = self.model.final_hidden(batch, self.kv_caches, self.backend)
        return pool(hidden, [len(p) for p in prompts], self.pooling.type)
