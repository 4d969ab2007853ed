"""blockd's wire protocol: every message a client and the daemon exchange, and its codec.

MessagePack frames over ZeroMQ, schema-checked by msgspec; the ops, the fencing by epoch and the error codes are
told in docs/architecture.md ("Protocol", "Registration, leases and re-sync").
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from blockd.errors import BlockdError, ErrorCode
from blockd.pool import MAX_GROUPS, AdmitResult, AppendResult, PoolStats
from blockd.tiers import TierOp, TierSpec
from common.limits import SUPPORTED_BLOCK_SIZES

PROTOCOL_VERSION: Final = 2  # 2: the `trim` op
DEFAULT_MAX_MESSAGE_BYTES: Final = 64 * 1024 * 1024
DEFAULT_ENDPOINT: Final = "tcp://127.0.0.1:5557"
#: Most ops one step may carry (a scheduler step holds a few per running sequence).
MAX_STEP_OPS: Final = 65_536

#: Token ids travel packed: little-endian uint32, 4 bytes each (common.tokens.pack_tokens). Compact, decoded
#: without per-id work, and hashed as they are.
PackedTokens = bytes
Count = Annotated[int, msgspec.Meta(ge=0)]
#: A block table entry: a block, or -1 (blockd.pool.HOLE) for one handed back by `slide`.
TableEntry = Annotated[int, msgspec.Meta(ge=-1)]
Window = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
#: Slots reserved past a sequence's tokens for tokens not registered yet (blockd.block_rule; the pool checks the
#: exact bound, which depends on its block size: at most two blocks).
Reserved = Annotated[int, msgspec.Meta(ge=0, le=2 * max(SUPPORTED_BLOCK_SIZES))]
#: A lookup's cache salt: no longer than the gateway accepts from its clients.
Salt = Annotated[str, msgspec.Meta(max_length=1024)]
#: A KV tier's name in a lookup's answer (blockd.tiers: vLLM's `medium`, "CPU", "DISK", ...).
MediumName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
#: Most lower tiers one pool reports in a lookup, and most pools a lookup answers for: bounds on what a client
#: (the gateway) decodes from a blockd it does not control.
MAX_LOOKUP_MEDIA: Final = 8
MAX_LOOKUP_POOLS: Final = 4096


# ------------------------------------------------------------------------------------------ step ops


class Admit(msgspec.Struct, tag="admit"):
    seq_id: Name
    tokens: PackedTokens
    cache_salt: str | None = None
    reuse_prefix: bool = True  # False: no prefix hit, every token is computed (e.g. for prompt logprobs)
    hold: Count | None = None  # register only this many tokens past the cached prefix (blockd.pool.admit)


class Append(msgspec.Struct, tag="append", omit_defaults=True):
    seq_id: Name
    tokens: PackedTokens
    reserve: Reserved = 0  # slots to keep reserved past the tokens: room for tokens computed before registered


class Commit(msgspec.Struct, tag="commit"):
    seq_id: Name
    num_computed_tokens: Count


class Slide(msgspec.Struct, tag="slide"):
    """Hand back the sequence's leading blocks that no query from `num_computed_tokens` on reads (pools with a
    sliding window: blockd.block_rule.dead_blocks); they become holes in its table."""

    seq_id: Name
    num_computed_tokens: Count


class Fork(msgspec.Struct, tag="fork"):
    parent_id: Name
    child_id: Name


class Free(msgspec.Struct, tag="free"):
    seq_id: Name


class Trim(msgspec.Struct, tag="trim"):
    """Keep `reserve` of the sequence's reserved slots (no more than it holds) and hand back the blocks past its
    tokens and them (blockd.block_rule.trimmed_blocks): room given back, e.g. speculative drafts' (v2)."""

    seq_id: Name
    reserve: Reserved = 0


StepOp = Admit | Append | Commit | Slide | Fork | Free | Trim


class CommitResult(msgspec.Struct, tag="commit", omit_defaults=True):
    added: int  # new prefix-index entries
    # Writes of the new entries to the deployment's shared KV tier (and the discards that make room), run before
    # the step's forward pass as every tier op (blockd.tiers). Not sent when empty: version 2 stands.
    tier_ops: tuple[TierOp, ...] = ()


class SlideResult(msgspec.Struct, tag="slide"):
    released: int  # blocks handed back (references dropped)


class ForkResult(msgspec.Struct, tag="fork"):
    pass


class FreeResult(msgspec.Struct, tag="free"):
    freed: int  # blocks released (references dropped)


class TrimResult(msgspec.Struct, tag="trim"):
    released: int  # blocks handed back


class OpError(msgspec.Struct, tag="error", omit_defaults=True):
    code: str
    message: str
    missing_blocks: int = 0


StepOpResult = AdmitResult | AppendResult | CommitResult | SlideResult | ForkResult | FreeResult | TrimResult | OpError


# ------------------------------------------------------------------------------------------ requests


class LiveSequence(msgspec.Struct):
    """A live sequence as its executor holds it, sent on (re-)registration."""

    seq_id: Name
    tokens: PackedTokens
    blocks: list[TableEntry]
    num_computed_tokens: Count
    cache_salt: str | None = None
    reserved: Reserved = 0
    # Layer groups 1..'s tables (a pool with layer groups; `blocks` is group 0's).
    group_blocks: Annotated[list[list[TableEntry]], msgspec.Meta(max_length=MAX_GROUPS - 1)] = []


class Request(msgspec.Struct, tag_field="op", kw_only=True):
    v: int
    id: int


class Register(Request, tag="register"):
    """Register a pool, or re-register it: same epoch re-syncs the live sequences, a new epoch starts clean."""

    pool_id: Name
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    model_id: Name
    epoch: int
    sliding_window: Window | None = None  # every layer's: a block no query's window reaches goes back (`slide`)
    # Layer groups (blockd.pool.PoolSpec.group_sliding): whether each group slides by `sliding_window`. Older
    # daemons ignore the field; the result's `groups` tells the client whether this one took it.
    groups: Annotated[list[bool], msgspec.Meta(min_length=1, max_length=MAX_GROUPS)] | None = None
    sequences: list[LiveSequence] = []
    generations: list[Count] | None = None  # the executor's generation of every block (for re-sync)
    # Its lower KV tiers and what they hold (blockd.tiers). Optional, so the protocol version stands: without it
    # no reply carries tier ops or loads, byte for byte as before.
    tiers: TierSpec | None = None


class Unregister(Request, tag="unregister"):
    pool_id: Name
    epoch: int


class Heartbeat(Request, tag="heartbeat"):
    pool_id: Name
    epoch: int
    # The shared tier's writes finished and lost since the last report (as a step's): an idle executor's writes
    # become loadable within a heartbeat, not only at its next step.
    shared_written: Annotated[list[bytes], msgspec.Meta(max_length=MAX_STEP_OPS)] = []
    shared_drops: Annotated[list[bytes], msgspec.Meta(max_length=MAX_STEP_OPS)] = []


class Step(Request, tag="step"):
    """Every op of one scheduler step; the reply holds one result per op, in order. Ops are independent: one
    failing (say, out of blocks) leaves the others applied and changes nothing itself."""

    pool_id: Name
    epoch: int
    ops: Annotated[list[StepOp], msgspec.Meta(max_length=MAX_STEP_OPS)]
    # Hashes the executor's disk tier lost since its last step (a block file found bad at a load): blockd's
    # directory forgets them before the ops, so it neither loads them again nor thinks them kept (blockd.tiers).
    tier_drops: Annotated[list[bytes], msgspec.Meta(max_length=MAX_STEP_OPS)] = []
    # The shared tier's writes this executor finished since its last step (from then on they may be loaded), and
    # those it could not make or found bad at a load (blockd.tiers).
    shared_written: Annotated[list[bytes], msgspec.Meta(max_length=MAX_STEP_OPS)] = []
    shared_drops: Annotated[list[bytes], msgspec.Meta(max_length=MAX_STEP_OPS)] = []


class Lookup(Request, tag="lookup"):
    tokens: PackedTokens
    cache_salt: Salt | None = None


class Stats(Request, tag="stats"):
    pool_id: Name | None = None


class Pools(Request, tag="pools"):
    pass


class GetSequence(Request, tag="seq"):
    seq_id: Name
    pool_id: Name | None = None


class Check(Request, tag="check"):
    pass


class ResetPrefixCache(Request, tag="reset_prefix_cache"):
    """Drop a pool's cached prefixes. An executor sends its epoch (a mismatch is `stale_epoch`); an operator
    (blockd-cli) sends none."""

    pool_id: Name
    epoch: int | None = None


AnyRequest = Register | Unregister | Heartbeat | Step | Lookup | Stats | Pools | GetSequence | Check | ResetPrefixCache


# ------------------------------------------------------------------------------------------ results


class RegisterResult(msgspec.Struct):
    resynced: bool  # the same epoch was known: live sequences and cached prefixes carried over
    restored_sequences: int
    restored_index_entries: int
    dropped_index_entries: int  # persisted or in-memory entries the executor's generations no longer back
    lease_timeout_s: float
    groups: int = 1  # the pool's layer groups (one from a daemon that knows none)


class HeartbeatResult(msgspec.Struct):
    lease_timeout_s: float


class StepResult(msgspec.Struct):
    results: list[StepOpResult]


class LookupResult(msgspec.Struct, omit_defaults=True):
    """Per pool, how far along the prompt's block chain each medium goes, as an admit there would follow it
    (blockd.pool.BlockPool.tier_extent): the device's cached prefix, then the tokens each lower tier would load
    after it. `tier_tokens` is optional (empty, and so not sent, when no pool has any): a client that does not
    know it reads device hits as before, and one that does reads {} from a blockd that does not send it, so
    protocol version 2 stands. Media are open names: a tier added later slots into the same map."""

    cached_tokens: Annotated[dict[Name, Count], msgspec.Meta(max_length=MAX_LOOKUP_POOLS)]  # on the device
    # pool id -> medium -> prompt tokens after the device's prefix an admit there would load from that tier
    # (pools, and media, with none are left out)
    tier_tokens: Annotated[
        dict[Name, Annotated[dict[MediumName, Count], msgspec.Meta(max_length=MAX_LOOKUP_MEDIA)]],
        msgspec.Meta(max_length=MAX_LOOKUP_POOLS),
    ] = {}


class PersistenceStats(msgspec.Struct):
    enabled: bool
    state: str  # "off", "ok" or "degraded"
    redis: str  # where (credentials removed)
    lag_s: float  # age of the oldest index change Redis has not acknowledged (0 when none)
    flush_interval_s: float
    pending_batches: int
    entries_written: int
    full_rewrites: int
    last_error: str | None = None
    key_prefix: str = ""  # every key blockd writes starts with it (--redis-prefix)
    skipped_records: int = 0  # corrupt or unknown-version records found in Redis and left out
    writer_restarts: int = 0  # the writer thread died and was started again
    dropped_batches: int = 0  # batches not queued for Redis because the writer's queue was full
    queue_limit: int = 0  # batches the writer's queue holds at most


class Totals(msgspec.Struct):
    pools: int
    blocks_total: int
    blocks_in_use: int
    blocks_cached_free: int
    blocks_never_used: int
    live_sequences: int
    kv_utilization: float
    prefix_hit_rate_tokens: float
    prefix_hit_rate_blocks: float
    evictions: int


class StatsResult(msgspec.Struct):
    version: str
    uptime_s: float
    pools: list[PoolStats]
    totals: Totals
    persistence: PersistenceStats
    dormant_pools: list[str]  # restored from Redis, waiting for their executor to re-register


class PoolInfo(msgspec.Struct):
    pool_id: str
    model_id: str
    epoch_fingerprint: str  # not the epoch: a short one-way digest of it (the epoch is its executor's secret)
    num_blocks: int
    block_size: int
    live_sequences: int
    last_seen_s: float  # seconds since its executor was last heard from


class PoolsResult(msgspec.Struct):
    pools: list[PoolInfo]
    lease_timeout_s: float


class SequenceInfo(msgspec.Struct):
    pool_id: str
    seq_id: str
    num_tokens: int
    committed_blocks: int
    blocks: list[int]
    refcounts: list[int]


class CheckResult(msgspec.Struct):
    problems: list[str]


class ResetResult(msgspec.Struct):
    dropped: int


class ErrorInfo(msgspec.Struct):
    code: str
    message: str


class Reply(msgspec.Struct, omit_defaults=True):
    """A reply as the daemon encodes it; `result` holds the op's result struct."""

    v: int
    id: int
    ok: bool
    result: Any = None
    error: ErrorInfo | None = None


class RawReply(msgspec.Struct):
    """A reply as a client decodes it: the result stays raw until the caller names its type."""

    v: int
    id: int
    ok: bool
    result: msgspec.Raw = msgspec.Raw(b"\xc0")
    error: ErrorInfo | None = None


RESULT_TYPES: Final[dict[type[Request], type]] = {
    Register: RegisterResult,
    Unregister: ResetResult,
    Heartbeat: HeartbeatResult,
    Step: StepResult,
    Lookup: LookupResult,
    Stats: StatsResult,
    Pools: PoolsResult,
    GetSequence: SequenceInfo,
    Check: CheckResult,
    ResetPrefixCache: ResetResult,
}

# ------------------------------------------------------------------------------------------ codec


class _Header(msgspec.Struct):
    """The least a request must have, decoded only to explain why a full decode failed."""

    v: Any = None
    id: Any = None
    op: Any = None


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(AnyRequest)
_header_decoder = msgspec.msgpack.Decoder(_Header)
_reply_decoder = msgspec.msgpack.Decoder(RawReply)
_KNOWN_OPS: Final = frozenset(t.__struct_config__.tag for t in AnyRequest.__args__)  # type: ignore[attr-defined]


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_request(frame: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> AnyRequest:
    """Decode one request frame, or raise a BlockdError saying exactly what is wrong with it.

    The error carries the request id when one could be read, so the client can match the reply.
    """
    if len(frame) > max_bytes:
        raise RequestError(ErrorCode.TOO_LARGE, f"message of {len(frame)} bytes exceeds the limit of {max_bytes}", 0)
    try:
        request = _request_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise _explain(frame, exc) from None
    if request.v != PROTOCOL_VERSION:
        raise RequestError(
            ErrorCode.BAD_VERSION,
            f"protocol version {request.v} is not spoken here; this blockd speaks {PROTOCOL_VERSION}",
            request.id,
        )
    return request


class RequestError(BlockdError):
    """A request that could not be decoded or is not acceptable, with the id to answer it under."""

    def __init__(self, code: ErrorCode, message: str, request_id: int) -> None:
        super().__init__(code, message)
        self.request_id = request_id


def _explain(frame: bytes, exc: Exception) -> RequestError:
    try:
        header = _header_decoder.decode(frame)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return RequestError(ErrorCode.BAD_MESSAGE, f"not a MessagePack map with v, id and op: {exc}", 0)
    request_id = header.id if isinstance(header.id, int) and not isinstance(header.id, bool) else 0
    if header.v != PROTOCOL_VERSION:
        return RequestError(
            ErrorCode.BAD_VERSION,
            f"protocol version {header.v!r} is not spoken here; this blockd speaks {PROTOCOL_VERSION}",
            request_id,
        )
    if header.op not in _KNOWN_OPS:
        known = ", ".join(sorted(_KNOWN_OPS))
        return RequestError(ErrorCode.UNKNOWN_OP, f"unknown op {header.op!r}; known ops: {known}", request_id)
    return RequestError(ErrorCode.INVALID_REQUEST, f"invalid {header.op!r} request: {exc}", request_id)


def encode_ok(request_id: int, result: msgspec.Struct) -> bytes:
    return _encoder.encode(Reply(PROTOCOL_VERSION, request_id, True, result))


def encode_error(request_id: int, code: str, message: str) -> bytes:
    return _encoder.encode(Reply(PROTOCOL_VERSION, request_id, False, None, ErrorInfo(code, message)))


def decode_reply(frame: bytes) -> RawReply:
    return _reply_decoder.decode(frame)


_result_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def decode_result(raw: msgspec.Raw, result_type: type) -> Any:
    decoder = _result_decoders.get(result_type)
    if decoder is None:
        decoder = _result_decoders[result_type] = msgspec.msgpack.Decoder(result_type)
    return decoder.decode(raw)
