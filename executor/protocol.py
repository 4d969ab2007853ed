"""The executor's ZeroMQ protocol, spoken by gateways (DEALER) to an executor (ROUTER): msgpack via msgspec,
tagged by `type`, each message with the protocol version `v`. The messages and their bounds: docs/architecture.md
("Gateway protocol"). Unasked, every
`ALIVE_INTERVAL_S`, the executor sends `Alive` from a thread of its own, so a long step is not silence.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import msgspec

from executor.params import SamplingParams

PROTOCOL_VERSION = 1
DEFAULT_BIND = "tcp://127.0.0.1:5560"
ALIVE_INTERVAL_S = 0.25  # how often an executor says it is alive; a gateway's lease is several of these


class RejectCode(StrEnum):
    """The stable codes of `Rejected`: gateways branch on them, people read the message."""

    INVALID_REQUEST = "invalid_request"  # undecodable, bad params, empty prompt, token ids out of the vocabulary
    UNSUPPORTED_VERSION = "unsupported_version"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt leaves no room to generate in max_model_len
    CAPACITY_EXCEEDED = "capacity_exceeded"  # one sequence of this prompt would not fit this executor's KV cache
    DUPLICATE_REQUEST = "duplicate_request"
    QUEUE_FULL = "queue_full"  # past --max-queued-requests
    NOT_OWNER = "not_owner"  # an Abort from a connection that did not submit the request
    # Sent a step or more after the submit, once the grammar compiler has answered:
    INVALID_GRAMMAR = "invalid_grammar"  # the structured-output constraint does not compile
    STRUCTURED_OUTPUT_UNAVAILABLE = "structured_output_unavailable"  # no tokenizer here, or xgrammar broken
    FORBIDDEN = "forbidden"  # with keys: the sender's role may not send this message
    WRONG_TASK = "wrong_task"  # a submit to an embedding executor, or an embed to a generating one
    EMBEDDING_FAILED = "embedding_failed"  # an embedding pass raised (out of memory...): that request alone fails


RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]


class Message(msgspec.Struct, tag_field="type", kw_only=True):
    v: int = PROTOCOL_VERSION


class Submit(Message, tag="submit"):
    request_id: RequestId
    prompt: bytes  # packed token ids
    params: SamplingParams = SamplingParams()
    cache_salt: str | None = None


class Abort(Message, tag="abort"):
    request_id: RequestId
    index: int | None = None  # one choice only (a gateway saw its stop string); None: the whole request


class GetLoad(Message, tag="get_load"):
    pass


class GetInfo(Message, tag="get_info"):
    pass


class Embed(Message, tag="embed"):
    """Pooled embeddings of prompts (an executor started with --task embed): answered by one `Embedded`."""

    request_id: RequestId
    prompts: list[bytes]  # packed token ids, one entry per input
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = (
        None  # Matryoshka: keep the first `dimensions` (then normalise, if asked)
    )
    normalize: bool | None = None  # None: the model's own (its sentence-transformers Normalize module)


Inbound = Submit | Abort | GetLoad | GetInfo | Embed


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens at this position, best first
    rank: int | None = None  # of token_id among all tokens (1 = the most likely); set for prompt logprobs


class Delta(Message, tag="delta"):
    request_id: str
    index: int  # which choice (0 .. n - 1)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # of this choice so far
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied
    # Asked with SamplingParams.prompt_logprobs: one entry per prompt token after the first (the first has no
    # logprob), sent once, in the request's first delta.
    prompt_logprobs: list[TokenLogprob] | None = None


class Rejected(Message, tag="rejected"):
    request_id: str
    code: str  # a RejectCode; a plain string on the wire, so a gateway reads codes newer than its own
    message: str


class LoadReport(Message, tag="load"):
    pool_id: str
    running: int
    waiting: int
    free_blocks: int
    num_blocks: int
    kv_utilization: float  # blocks held by live sequences / all blocks
    preemptions: int
    steps: int
    blockd_reachable: bool = True  # False while blockd is away: generation waits, nothing is lost
    # Measured throughput, since the executor started: seconds spent in forward passes, and the tokens they
    # computed (prefill and decode). A gateway estimates from them how long queued work will take.
    busy_s: float = 0.0
    computed_tokens: int = 0
    step_token_budget: int = 0  # the token budget of the next step (--max-step-ms sizes it; 0: not reported)
    # Tokens its requests (from every gateway) may still need computed: prompts' rest, choices' max_tokens left.
    queued_tokens: int = 0
    # The lower KV tiers' counters (executor.tier_store): saves, spills, loads, writes and dropped block files
    # by reason (corrupt, truncated, foreign, stale). Empty without tiers.
    tiers: dict[str, int] = {}
    # Speculative decoding (--speculative-config), since the executor started: drafted rows verified, draft
    # tokens proposed and accepted (acceptance rate = accepted / proposed).
    spec_drafts: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


class Alive(Message, tag="alive"):
    """The executor's process is alive: sent by its liveness thread, whatever its step loop is doing."""

    pool_id: str
    steps: int  # steps that ran a forward pass so far: unchanged for long while one long step runs
    step_s: float = 0.0  # how long the step in progress has run (0: between steps)


class Info(Message, tag="info"):
    pool_id: str
    model_id: str
    model_dir: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    device: str
    eos_token_ids: list[int]
    task: str = "generate"  # "generate" | "embed" (--task): which requests this executor serves


class Embedded(Message, tag="embedded"):
    request_id: str
    embeddings: list[bytes]  # one per prompt, in order: little-endian float32
    prompt_tokens: int


Outbound = Delta | Rejected | LoadReport | Info | Embedded | Alive

_encoder = msgspec.msgpack.Encoder()
_inbound = msgspec.msgpack.Decoder(Inbound)
_outbound = msgspec.msgpack.Decoder(Outbound)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode_inbound(frame: bytes) -> Inbound:
    """Raises msgspec.DecodeError / ValidationError on garbage or a bad field."""
    return _inbound.decode(frame)


def decode_outbound(frame: bytes) -> Outbound:
    return _outbound.decode(frame)
