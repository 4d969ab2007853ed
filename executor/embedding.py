"""One `Embed` request, checked and answered: `Embedded` with a float32 vector per prompt, or `Rejected` (with a
stable code, nothing else changed) for a request this executor cannot serve."""

from __future__ import annotations

from common.tokens import TOKEN_BYTES, unpack_tokens
from executor import protocol as ep
from executor.model_config import ModelConfig
from executor.pooling import Embedder


def embed_request(embedder: Embedder | None, message: ep.Embed, config: ModelConfig) -> ep.Embedded | ep.Rejected:
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
    pooling = embedder.pooling
    normalize = pooling.normalize if message.normalize is None else message.normalize
    vectors = embedder.embed(prompts, message.dimensions, normalize).cpu().contiguous()
    return ep.Embedded(
        request_id=message.request_id,
        embeddings=[row.numpy().astype("<f4").tobytes() for row in vectors],
        prompt_tokens=sum(len(p) for p in prompts),
    )


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
