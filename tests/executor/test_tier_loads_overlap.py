"""Disk loads run beside the step, not in it: an in-process engine on a real blockd, with a disk tier whose file
reads are held at a gate (and the step's thread kept from reading them itself while it waits, as it does by
default: executor.tier_store.TierStore._wait). While a revisited prompt's blocks are still reading, the other
sequences keep decoding, the loading one is not scheduled, and blockd's index does not offer its blocks; once the
reads land, its greedy output equals transformers'. A sequence aborted mid-load has its late reads thrown away
(its blocks serve another request, whose output stays right), and a file found bad when read makes its sequence
compute from that block. The store alone, under hypothesis: a read lands only while its ticket is kept.
"""

from __future__ import annotations

import tempfile
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import executor.tier_store as tier_store
from blockd.hashing import chain_hashes, extra_key, root_hash
from blockd.tiers import MEDIUM_DISK, TierOp
from executor.engine import Engine, EngineLimits
from executor.kv_tiers import KvLayout, write_block_file
from executor.params import SamplingParams
from executor.runner import kv_layout
from executor.tier_store import TierStore
from tests.executor.harness import Choice, _loaded, check_sequence_invariants, hf_greedy, random_prompts
from tests.support.waiting import wait_for

BS = 16
VOCAB = 512
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class GatedReads:
    """Stands in front of the real file read: every read waits for the gate (a slow or busy disk)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()
        self._real = tier_store.read_block_file

    def __call__(self, *args: object) -> memoryview:
        with self._lock:
            self.entered += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return self._real(*args)  # type: ignore[arg-type]


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[GatedReads]:
    reads = GatedReads()
    monkeypatch.setattr(tier_store, "read_block_file", reads)
    yield reads
    reads.gate.set()  # (a failing test must not leave reader threads waiting)


def _engine(model: Path, endpoint: str, disk: Path, pool_id: str) -> tuple[Engine, TierStore]:
    loaded = _loaded(model)
    engine = Engine.assemble(
        loaded,
        endpoint,
        pool_id=pool_id,
        num_blocks=24,
        block_size=BS,
        limits=EngineLimits(4, 64),
        seed=0,
        retry_for_s=20.0,
    )
    store = TierStore(kv_layout(loaded, BS), engine.runner.kv_caches, disk_dir=disk, disk_bytes=1 << 24)
    engine.model_step.tiers = store
    engine.pool.tiers = store.spec
    engine.pool.tier_drops = store.take_drops
    engine.pool.shared_reports = store.take_shared_reports
    engine.pool.register()
    return engine, store


def _step(engine: Engine, results: dict[str, Choice]) -> None:
    for delta in engine.step():
        choice = results.setdefault(delta.request_id, Choice())
        choice.tokens += delta.token_ids
        choice.finish_reason = delta.finish_reason
        choice.cached_tokens = delta.cached_tokens
    check_sequence_invariants(engine)


def _run_all(engine: Engine, results: dict[str, Choice], steps: int = 2000) -> None:
    for _ in range(steps):
        if not engine.has_work():
            return
        _step(engine, results)
    raise AssertionError("the engine did not finish")


def _demote_to_disk(engine: Engine, store: TierStore, prompt: list[int], seed: int) -> None:
    """Serve `prompt`, then enough other prompts that its cached blocks are evicted to the disk, written whole."""
    results: dict[str, Choice] = {}
    engine.add_request("first", prompt, GREEDY)
    _run_all(engine, results)
    for i, filler in enumerate(random_prompts([100] * 6, vocab=VOCAB, seed=seed)):
        engine.add_request(f"filler-{i}", filler, GREEDY)
        _run_all(engine, results)
    wait_for(lambda: store.pending_writes() == 0, timeout_s=30, what="the disk writes")  # (reads meet files)
    assert store.counters["saves_disk"] >= len(prompt) // BS


def _loading(engine: Engine, request_id: str) -> dict[int, int]:
    return engine.requests[request_id].sequences[0].loading


def _demoted_with_held_reads(model: Path, blockd, tmp_path: Path, pool: str, seed: int, extra: int):
    """An engine whose disk reads the gate holds (the step's thread kept out of them: it would wait inside a held
    read, as on a hung disk), a prompt of six blocks demoted to its disk, and that prompt revisited with `extra`
    more tokens."""
    engine, store = _engine(model, blockd.endpoint, tmp_path / "disk", pool)
    store.help_with_reads = False
    prompt = random_prompts([96], vocab=VOCAB, seed=seed)[0]
    _demote_to_disk(engine, store, prompt, seed=seed + 1)
    return engine, store, prompt + random_prompts([extra], vocab=VOCAB, seed=seed + 2)[0]


def _step_until_loading(engine: Engine, results: dict[str, Choice], request_id: str) -> dict[int, int]:
    for _ in range(10):
        _step(engine, results)
        if _loading(engine, request_id):
            break
    return _loading(engine, request_id)


def test_other_sequences_decode_while_a_revisited_prompt_reads_from_disk(tiny_models, blockd, tmp_path, gated):
    model = tiny_models["llama"]
    engine, store, revisit = _demoted_with_held_reads(model, blockd, tmp_path, "overlap", seed=1, extra=20)
    with blockd.client() as client:
        before = client.lookup_tiers(revisit)
    assert before.cached_tokens.get("overlap", 0) == 0 and before.tier_tokens["overlap"]["DISK"] == 96

    results: dict[str, Choice] = {}
    other = random_prompts([20], vocab=VOCAB, seed=4)[0]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.add_request("other", other, long)
    _step(engine, results)
    engine.add_request("revisit", revisit, GREEDY)
    assert len(_step_until_loading(engine, results, "revisit")) == 6  # its six blocks are reading, behind the gate
    decoded = len(results["other"].tokens)
    for _ in range(5):
        _step(engine, results)
    # The step went on without the loads: the other request decoded a token each step...
    assert len(results["other"].tokens) == decoded + 5
    # ... and the loading one did not run, nor did blockd's index offer its blocks to anyone.
    assert "revisit" not in results or not results["revisit"].tokens
    wait_for(lambda: gated.entered >= 1, timeout_s=30, what="a reader at the gate")
    assert store.counters["loads_disk"] == 0
    with blockd.client() as client:
        assert client.lookup_tiers(revisit).cached_tokens.get("overlap", 0) == 0

    gated.gate.set()
    _run_all(engine, results)
    assert results["revisit"].cached_tokens == 96
    assert results["revisit"].tokens == hf_greedy(model, revisit, GREEDY.max_tokens)
    assert results["other"].tokens == hf_greedy(model, other, long.max_tokens)
    assert store.counters["loads_disk"] == 6 and store.counters["loads_abandoned"] == 0
    with blockd.client() as client:  # landed and committed: a device hit now
        assert client.lookup_tiers(revisit).cached_tokens["overlap"] == 112
    store.flush()


def test_a_sequence_aborted_mid_load_never_gets_its_late_bytes_into_blocks_that_serve_another(
    tiny_models, blockd, tmp_path, gated
):
    model = tiny_models["llama"]
    engine, store, revisit = _demoted_with_held_reads(model, blockd, tmp_path, "abort", seed=5, extra=8)
    results: dict[str, Choice] = {}
    engine.add_request("revisit", revisit, GREEDY)
    loading_blocks = set(_step_until_loading(engine, results, "revisit").values())
    assert len(loading_blocks) == 6
    engine.abort("revisit")
    # Its blocks go back; a new request, long enough to need most of the cache, is granted them.
    fresh = random_prompts([150], vocab=VOCAB, seed=8)[0]
    engine.add_request("fresh", fresh, GREEDY)
    for _ in range(20):
        _step(engine, results)
        if "fresh" in engine.requests and set(engine.pool.seqs["fresh#0"].blocks) & loading_blocks:
            break
    assert set(engine.pool.seqs["fresh#0"].blocks) & loading_blocks  # (else the test shows nothing)
    gated.gate.set()  # the abandoned reads finish now, into nothing
    _run_all(engine, results)
    assert results["fresh"].tokens == hf_greedy(model, fresh, GREEDY.max_tokens)
    assert store.counters["loads_disk"] == 0

    def thrown_away() -> bool:  # (the reader threads finish the six reads; a step throws each away)
        engine.step()
        return store.counters["loads_abandoned"] == 6

    wait_for(thrown_away, timeout_s=30, what="the six abandoned reads thrown away")
    store.flush()


def test_a_file_found_bad_once_read_makes_its_sequence_compute_from_that_block(tiny_models, blockd, tmp_path):
    model = tiny_models["llama"]
    engine, store = _engine(model, blockd.endpoint, tmp_path / "disk", "bad")
    prompt = random_prompts([96], vocab=VOCAB, seed=9)[0]
    _demote_to_disk(engine, store, prompt, seed=10)
    # The fourth block's file: a payload byte flipped (only reading it whole, and its checksum, tells).
    hashes = chain_hashes(prompt, BS, root_hash(), extra_key(engine.pool.model_id))
    path = tmp_path / "disk" / f"{hashes[3].hex()}.kvb"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x40
    path.write_bytes(bytes(data))
    revisit = prompt + random_prompts([20], vocab=VOCAB, seed=11)[0]
    results: dict[str, Choice] = {}
    engine.add_request("revisit", revisit, GREEDY)
    _run_all(engine, results)
    assert results["revisit"].cached_tokens == 3 * BS  # the three blocks before the bad one
    assert results["revisit"].tokens == hf_greedy(model, revisit, GREEDY.max_tokens)
    assert store.report()["dropped_corrupt"] == 1 and not path.exists()
    store.flush()


# ------------------------------------------------------------------------------------------ the store alone

LAYOUT = KvLayout("tiny-m", "float32", 1.0, 1.0, 4, 2, 1, 8, 4)  # 256 bytes a layer's block
FILES = 6
DEVICE_BLOCKS = 4

# One step of a program: ("load", file, device block) begins a load; ("drop", k) abandons the k-th live ticket
# (its sequence freed); ("land", wait) lands what has finished; ("corrupt", file) flips a byte of a file.
programs = st.lists(
    st.one_of(
        st.tuples(st.just("load"), st.integers(0, FILES - 1), st.integers(0, DEVICE_BLOCKS - 1)),
        st.tuples(st.just("drop"), st.integers(0, 7)),
        st.tuples(st.just("land"), st.booleans()),
        st.tuples(st.just("corrupt"), st.integers(0, FILES - 1)),
    ),
    max_size=30,
)


def _device(store: TierStore, block: int) -> bytes:
    return store._device_block(block).numpy().tobytes()


@settings(max_examples=60, deadline=None)
@given(program=programs)
def test_a_read_lands_only_while_its_ticket_is_kept_and_every_ticket_ends_once(program) -> None:
    """Whatever the order of loads, abandonments and landings: a device block only ever holds what it held or the
    payload of a load still wanted when it landed; an abandoned read never lands; a bad file never lands; and
    each ticket ends exactly once (loaded, failed or abandoned)."""
    with tempfile.TemporaryDirectory() as scratch:
        disk = Path(scratch)
        caches = [(torch.zeros(DEVICE_BLOCKS, 4, 1, 8), torch.zeros(DEVICE_BLOCKS, 4, 1, 8)) for _ in range(2)]
        store = TierStore(LAYOUT, caches, disk_dir=disk, disk_bytes=1 << 20)
        hashes = [bytes([i + 1]) * 16 for i in range(FILES)]
        payloads = [bytes([i + 1]) * LAYOUT.block_bytes for i in range(FILES)]
        for h, payload in zip(hashes, payloads, strict=True):
            write_block_file(disk / f"{h.hex()}.kvb", LAYOUT, h, payload)
            store.disk[h] = None
        corrupt: set[int] = set()
        bad_at_start: set[int] = set()  # tickets whose file was damaged before the load began
        live: dict[int, tuple[int, int]] = {}  # ticket -> (file, device block)
        ended: Counter[int] = Counter()
        allowed = {b: {_device(store, b)} for b in range(DEVICE_BLOCKS)}  # what each block may hold now

        def land(wait: bool) -> None:
            landed = store.land(set(live), wait_s=5.0 if wait else 0.0)
            for ticket in landed.loaded:
                i, block = live.pop(ticket)
                assert ticket not in bad_at_start  # (a file damaged after its open may have been read before)
                allowed[block] = {payloads[i]}
                ended[ticket] += 1
            for ticket in landed.failed:
                i, _ = live.pop(ticket)
                assert i in corrupt
                ended[ticket] += 1
            for block in range(DEVICE_BLOCKS):
                assert _device(store, block) in allowed[block]

        for step in program:
            if step[0] == "load" and hashes[step[1]] in store.disk:
                moved = store.run([TierOp("load", MEDIUM_DISK, hashes[step[1]], block=step[2])])
                for ticket in moved.reading.values():
                    # (one block per sequence: a newer load into a block replaces the older one's claim)
                    for other, (_, block) in list(live.items()):
                        if block == step[2]:
                            del live[other]
                            ended[other] += 1
                    live[ticket] = (step[1], step[2])
                    if step[1] in corrupt:
                        bad_at_start.add(ticket)
            elif step[0] == "drop" and live:
                ticket = sorted(live)[step[1] % len(live)]
                del live[ticket]
                ended[ticket] += 1  # abandoned
            elif step[0] == "land":
                land(step[1])
            elif step[0] == "corrupt" and step[1] not in corrupt:
                path = disk / f"{hashes[step[1]].hex()}.kvb"
                data = bytearray(path.read_bytes())
                data[-1] ^= 1
                path.write_bytes(bytes(data))
                corrupt.add(step[1])
        while live:
            land(True)
        store.land(set(), wait_s=0.0)
        store.flush()
        assert store.land(set()).in_flight == 0
        begun = next(store._tickets)
        assert sorted(ended) == list(range(begun)) and set(ended.values()) <= {1}
        counted = store.counters["loads_disk"] + store.counters["loads_abandoned"] + sum(store.dropped().values())
        assert counted == begun
