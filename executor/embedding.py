"""`Embed` requests, checked and answered a pass at a time: `start_embedding` checks one (prompts, context,
`dimensions`) and gives an `EmbedJob`, or the `Rejected` (stable code, nothing else changed); the server runs one
pass of the job at the head of its queue per turn of its loop, so a request of many inputs never keeps it from
answering `get_load` for longer than one pass (a gateway would take a silent executor for a hung one)."""

from __future__ import annotations

import torch

from common.tokens import TOKEN_BYTES, unpack_tokens
from executor import protocol as ep
from executor.model_config import ModelConfig
from executor.pooling import Embedder, finish


class EmbedJob:
    def __init__(self, embedder: Embedder, message: ep.Embed, prompts: list[list[int]], normalize: bool) -> None:
        self.embedder = embedder
        self.request_id = message.request_id
        self.dimensions = message.dimensions
        self.normalize = normalize
        self.prompt_tokens = sum(len(p) for p in prompts)
        self._batches = embedder.batches(prompts)
        self._done: list[torch.Tensor] = []

    def step(self) -> ep.Embedded | None:
        """Run the next pass; the answer once the last one is done."""
        self._done.append(self.embedder.run(self._batches[len(self._done)]))
        if len(self._done) < len(self._batches):
            return None
        vectors = finish(torch.cat(self._done), self.dimensions, self.normalize).cpu()
        return ep.Embedded(
            request_id=self.request_id,
            embeddings=[row.numpy().astype("<f4").tobytes() for row in vectors],
            prompt_tokens=self.prompt_tokens,
        )


def start_embedding(embedder: Embedder | None, message: ep.Embed, config: ModelConfig) -> EmbedJob | ep.Rejected:
    def reject(code: ep.RejectCode, text: str) -> ep.Rejected:
        return ep.Rejected(request_id=message.request_id, code=code, message=text)

    if embedder is None:
        return reject(
            ep.RejectCode.WRONG_TASK, "this executor generates text; embeddings need one started with --task embed"
        )
    if not message.prompts:
        return reject(ep.RejectCode.INVALID_REQUEST, "no prompts to embed")
    limit, vocab = config.max_model_len, config.vocab_size
    prompts: list[list[int]] = []
    for i, packed in enumerate(message.prompts):
        if len(packed) % TOKEN_BYTES:
            return reject(ep.RejectCode.INVALID_REQUEST, f"prompt {i} must be packed uint32 token ids")
        n = len(packed) // TOKEN_BYTES
        if n == 0:
            return reject(ep.RejectCode.INVALID_REQUEST, f"prompt {i} is empty")
        if n > limit:
            return reject(
                ep.RejectCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt {i} has {n} tokens; this model's context is {limit} tokens",
            )
        tokens = unpack_tokens(packed)
        if max(tokens) >= vocab:
            return reject(ep.RejectCode.INVALID_REQUEST, f"prompt {i}: token ids must be in [0, {vocab})")
        prompts.append(tokens)
    problem = dimensions_problem(embedder, message.dimensions)
    if problem:
        return reject(ep.RejectCode.INVALID_REQUEST, problem)
    normalize = embedder.pooling.normalize if message.normalize is None else message.normalize
    return EmbedJob(embedder, message, prompts, normalize)


def dimensions_problem(embedder: Embedder, dimensions: int | None) -> str | None:
    """Why `dimensions` cannot be served, or None."""
    if dimensions is None:
        return None
    hidden = embedder.config.hidden_size
    pooling = embedder.pooling
    if not pooling.matryoshka:
        return (
            "dimensions: this model is not known to support Matryoshka embeddings (its config.json sets neither "
            "is_matryoshka nor matryoshka_dimensions); start the executor with --allow-any-dimensions to truncate "
            "anyway"
        )
    if not 1 <= dimensions <= hidden:
        return f"dimensions must be between 1 and the model's {hidden}, not {dimensions}"
    if pooling.matryoshka_dimensions is not None and dimensions not in pooling.matryoshka_dimensions:
        allowed = ", ".join(map(str, pooling.matryoshka_dimensions))
        return f"dimensions must be one this model was trained for ({allowed}), not {dimensions}"
    return None
