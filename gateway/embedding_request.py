"""The body of `/v1/embeddings`, as OpenAI defines it, with vLLM's extensions (`truncate_prompt_tokens`,
`add_special_tokens`, `normalize`). Unknown fields are refused, as on every endpoint."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    # One text, one token-id list, or a batch of either (mixed as well).
    input: StrictStr | TokenIds | Annotated[list[StrictStr | TokenIds], Field(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extensions
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)  # keep each input's last N tokens
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: the model's own (normalised unless its config says otherwise)

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a batch: one text or token list is a batch of one."""
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]  # type: ignore[list-item]
        return list(self.input)  # type: ignore[arg-type]
