"""`pagedkv_kernels.moe.experts`: the grouped torch path and the Triton kernel (interpreted on the CPU)
against the float64 per-token reference on fresh random shapes; the reference against transformers' own expert
modules; the grouped path never touching an expert no token chose; and the checks that refuse bad calls."""

from __future__ import annotations

import os

import pytest
import torch

from pagedkv_kernels import linear as cpu_linear
from pagedkv_kernels import moe

DEVICE = torch.device(os.environ.get("PAGEDKV_TEST_DEVICE", "cpu"))


def _case(seed: int, tokens: int, hidden: int, inter: int, num_experts: int, top_k: int, *, biased: bool):
    """Random inputs in float64; each token's k experts distinct (as a router's top-k), some experts unchosen."""
    gen = torch.Generator().manual_seed(seed)
    # Draw the choices from a subset so that, for most shapes, some experts are hit by no token.
    pool = max(top_k, num_experts - 2)
    ids = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen, dtype=torch.float64), dim=-1)
    scale = hidden**-0.5
    case = dict(
        hidden=torch.randn(tokens, hidden, generator=gen, dtype=torch.float64),
        expert_ids=ids,
        expert_weights=weights,
        w_gate_up=torch.randn(num_experts, 2 * inter, hidden, generator=gen, dtype=torch.float64) * scale * 2,
        w_down=torch.randn(num_experts, hidden, inter, generator=gen, dtype=torch.float64) * inter**-0.5,
    )
    if biased:
        case["b_gate_up"] = torch.randn(num_experts, 2 * inter, generator=gen, dtype=torch.float64)
        case["b_down"] = torch.randn(num_experts, hidden, generator=gen, dtype=torch.float64)
    return case


def _cast(case: dict, dtype: torch.dtype, device: torch.device = DEVICE) -> dict:
    """Float tensors to `dtype` (routing weights to float32, as routers give them), all to `device`."""
    cast = {}
    for name, t in case.items():
        if name == "expert_weights":
            t = t.float() if dtype != torch.float64 else t
        elif t.is_floating_point():
            t = t.to(dtype)
        cast[name] = t.to(device)
    return cast


def _oracle(case: dict, dtype: torch.dtype, activation: str) -> torch.Tensor:
    """The float64 reference on the inputs rounded to `dtype` exactly as the backend under test sees them."""
    rounded = {k: v.to(dtype).double() if v.is_floating_point() else v for k, v in case.items()}
    if dtype != torch.float64:
        rounded["expert_weights"] = case["expert_weights"].float().double()
    return moe.experts(**rounded, activation=activation, backend="reference")


SHAPES = [
    # seed, tokens, hidden, inter, experts, top_k, biased
    (1, 1, 32, 16, 4, 1, False),
    (2, 7, 48, 24, 8, 2, True),
    (3, 40, 64, 40, 16, 4, False),
    (4, 23, 72, 20, 6, 3, True),
]


@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float64, 1e-12), (torch.bfloat16, 3e-2)])
def test_grouped_matches_reference(shape, activation, dtype, tol):
    seed, tokens, hidden, inter, num_experts, top_k, biased = shape
    case = _case(seed, tokens, hidden, inter, num_experts, top_k, biased=biased)
    got = moe.experts(**_cast(case, dtype, torch.device("cpu")), activation=activation, backend="torch")
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    want = _oracle(case, dtype, activation)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def _random_shape(seed: int) -> tuple:
    """A fresh shape per seed: experts 4..16, top-k 1..4, tokens 1..40, H and I often not multiples of a tile."""
    gen = torch.Generator().manual_seed(1000 + seed)

    def pick(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    num_experts = pick(4, 16)
    return (seed, pick(1, 40), pick(16, 100), pick(8, 80), num_experts, pick(1, 4), bool(pick(0, 1)))


@pytest.mark.parametrize("seed", range(6))
def test_grouped_matches_reference_on_random_shapes(seed):
    shape = _random_shape(seed)
    case = _case(*shape[:-1], biased=shape[-1])
    activation = moe.ACTIVATIONS[seed % 3]
    got = moe.experts(**_cast(case, torch.float32, torch.device("cpu")), activation=activation, backend="torch")
    torch.testing.assert_close(got.double(), _oracle(case, torch.float32, activation), atol=2e-5, rtol=2e-5)


TRITON_DTYPES = [(torch.float32, 1e-5), (torch.float16, 2e-3)]
if DEVICE.type == "cuda":  # the interpreter computes bfloat16 wrongly
    TRITON_DTYPES.append((torch.bfloat16, 1.6e-2))


@pytest.mark.parametrize("activation", moe.ACTIVATIONS)
@pytest.mark.parametrize("shape", [*SHAPES, (14, 40, 40, 24, 4, 3, True), (16, 40, 24, 70, 4, 4, False)])
@pytest.mark.parametrize("dtype, tol", TRITON_DTYPES)
def test_triton_matches_reference(shape, activation, dtype, tol):
    seed, tokens, hidden, inter, num_experts, top_k, biased = shape
    case = _case(seed, tokens, hidden, inter, num_experts, top_k, biased=biased)
    got = moe.experts(**_cast(case, dtype), activation=activation, backend="triton")
    assert got.dtype == dtype and got.shape == (tokens, hidden) and got.device.type == DEVICE.type
    torch.testing.assert_close(got.double().cpu(), _oracle(case, dtype, activation), atol=tol, rtol=tol)


@pytest.mark.parametrize("seed", range(3))
def test_triton_matches_reference_on_random_shapes(seed):
    shape = _random_shape(100 + seed)
    case = _case(*shape[:-1], biased=shape[-1])
    activation = moe.ACTIVATIONS[seed % 3]
    got = moe.experts(**_cast(case, torch.float32), activation=activation, backend="triton")
    torch.testing.assert_close(got.double().cpu(), _oracle(case, torch.float32, activation), atol=1e-5, rtol=1e-5)


def test_triton_reads_strided_weights():
    """gpt-oss checkpoints hold gate_up as [E, H, 2I]: a transposed view must work as it is, no copy needed."""
    case = _case(15, 10, 48, 24, 6, 2, biased=True)
    strided = _cast(case, torch.float32)
    strided["w_gate_up"] = strided["w_gate_up"].transpose(1, 2).contiguous().transpose(1, 2)
    strided["w_down"] = strided["w_down"].transpose(1, 2).contiguous().transpose(1, 2)
    strided["hidden"] = torch.cat([strided["hidden"], strided["hidden"]], dim=1)[:, :48]
    got = moe.experts(**strided, activation="swiglu_oai", backend="triton")
    torch.testing.assert_close(got.double().cpu(), _oracle(case, torch.float32, "swiglu_oai"), atol=1e-5, rtol=1e-5)


def test_triton_plan_tiles_hold_one_expert_each():
    from pagedkv_kernels import dispatch

    plan = dispatch.triton_module("triton_moe", DEVICE)._plan
    ids = torch.tensor([[3, 0], [3, 5], [0, 3], [3, 7], [9, 3]])  # 7 and 9 out of range for 6 experts: dropped
    pairs, tile_experts = (t.cpu() for t in plan(ids.to(DEVICE), 6, 2))
    assert pairs.shape[0] == tile_experts.shape[0] * 2
    kept = {p for p in range(10) if 0 <= int(ids.flatten()[p]) < 6}
    assert sorted(p for p in pairs.tolist() if p >= 0) == sorted(kept)
    for tile, expert in enumerate(tile_experts.tolist()):
        rows = [p for p in pairs[tile * 2 : tile * 2 + 2].tolist() if p >= 0]
        if expert == 6:
            assert not rows  # a spare tile
        else:
            assert rows and all(int(ids.flatten()[p]) == expert for p in rows)
    assert tile_experts.tolist() == sorted(tile_experts.tolist())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_expert_that_no_token_chose_is_read(backend):
    device = torch.device("cpu") if backend == "torch" else DEVICE
    case = _cast(_case(5, 12, 32, 16, 8, 2, biased=True), torch.float32, device)
    chosen = set(case["expert_ids"].flatten().tolist())
    unchosen = [e for e in range(8) if e not in chosen]
    assert unchosen, "the case must leave some expert unchosen"
    want = moe.experts(**case, backend=backend)
    for name in ("w_gate_up", "w_down", "b_gate_up", "b_down"):
        case[name][unchosen] = float("nan")
    got = moe.experts(**case, backend=backend)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)  # Triton's atomic sums may round differently


def test_grouped_multiplies_once_per_chosen_expert(monkeypatch):
    case = _cast(_case(6, 9, 32, 16, 16, 2, biased=False), torch.float32, torch.device("cpu"))
    calls = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(moe.F, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or real_linear(x, w, b))
    moe.experts(**case, backend="torch")
    chosen = torch.bincount(case["expert_ids"].flatten(), minlength=16)
    # Two matmuls (gate_up, down) per chosen expert, each over exactly the rows routed to it.
    assert sorted(calls) == sorted([int(n) for n in chosen if n > 0] * 2)


def test_output_into_hidden_and_an_out_tensor():
    case = _cast(_case(7, 5, 32, 16, 4, 2, biased=False), torch.float32, torch.device("cpu"))
    want = moe.experts(**case, backend="torch")
    out = torch.full_like(want, float("nan"))
    assert moe.experts(**case, backend="torch", out=out) is out and torch.equal(out, want)
    hidden = case.pop("hidden")
    assert moe.experts(hidden, **case, backend="torch", out=hidden) is hidden
    torch.testing.assert_close(hidden, want)


def test_no_tokens():
    case = _cast(_case(8, 1, 32, 16, 4, 2, biased=False), torch.float32, torch.device("cpu"))
    empty = {k: v[:0] if k in ("hidden", "expert_ids", "expert_weights") else v for k, v in case.items()}
    for backend in ("torch", "reference"):
        assert moe.experts(**empty, backend=backend).shape == (0, 32)


def _gpt_oss_experts(num_experts: int, hidden: int, inter: int, gen: torch.Generator):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(num_local_experts=num_experts, hidden_size=hidden, intermediate_size=inter)
    module = GptOssExperts(config).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    # Theirs: x @ gate_up [E, H, 2I] with gate and up interleaved; ours: [E, 2I, H], gate half then up half.
    gate_up = module.gate_up_proj.detach().transpose(1, 2)
    bias = module.gate_up_proj_bias.detach()
    ours = dict(
        w_gate_up=torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1),
        b_gate_up=torch.cat([bias[:, ::2], bias[:, 1::2]], dim=1),
        w_down=module.down_proj.detach().transpose(1, 2),
        b_down=module.down_proj_bias.detach(),
    )
    return module, ours


def test_reference_equals_transformers_gpt_oss_experts():
    gen = torch.Generator().manual_seed(9)
    module, weights = _gpt_oss_experts(6, 32, 24, gen)
    x = torch.randn(11, 32, generator=gen, dtype=torch.float64) * 3  # large enough that the clamps bite
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(11)])
    routing = torch.softmax(torch.randn(11, 2, generator=gen, dtype=torch.float64), dim=-1)
    want = module(x, ids, routing)
    for backend in ("reference", "torch"):
        got = moe.experts(x, ids, routing, **weights, activation="swiglu_oai", backend=backend)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("activation, hidden_act", [("silu", "silu"), ("gelu_tanh", "gelu_pytorch_tanh")])
def test_reference_equals_transformers_mixtral_experts(activation, hidden_act):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    gen = torch.Generator().manual_seed(10)
    config = MixtralConfig(num_local_experts=5, hidden_size=32, intermediate_size=24, hidden_act=hidden_act)
    module = MixtralExperts(config).double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    x = torch.randn(13, 32, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(13)])
    routing = torch.softmax(torch.randn(13, 2, generator=gen, dtype=torch.float64), dim=-1)
    want = module(x, ids, routing)
    got = moe.experts(
        x,
        ids,
        routing,
        module.gate_up_proj.detach(),
        module.down_proj.detach(),
        activation=activation,
        backend="reference",
    )
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_swiglu_constants_are_options():
    case = _cast(_case(11, 6, 32, 16, 4, 2, biased=True), torch.float64, torch.device("cpu"))
    default = moe.experts(**case, activation="swiglu_oai", backend="torch")
    explicit = moe.experts(**case, activation="swiglu_oai", alpha=1.702, limit=7.0, backend="reference")
    other = moe.experts(**case, activation="swiglu_oai", alpha=1.0, limit=0.5, backend="torch")
    torch.testing.assert_close(default, explicit, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(default, other)
    torch.testing.assert_close(
        other, moe.experts(**case, activation="swiglu_oai", alpha=1.0, limit=0.5, backend="reference")
    )


def _good():
    return _cast(_case(12, 3, 32, 16, 4, 2, biased=True), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(hidden=torch.zeros(3, 32, 1)), ValueError, "hidden must be"),
        (dict(hidden=torch.zeros(3, 32, dtype=torch.int32)), TypeError, "hidden must be one of"),
        (dict(hidden=torch.zeros(32, 3).t()), ValueError, "dense along H"),
        (dict(expert_ids=torch.zeros(3, 2)), TypeError, "expert_ids must be int32 or int64"),
        (dict(expert_ids=torch.zeros(4, 2, dtype=torch.long)), ValueError, "expert_ids must be"),
        (dict(expert_ids=torch.tensor([[0, 1], [2, 4], [0, 3]])), ValueError, r"\[0, 4\), found 4"),
        (dict(expert_ids=torch.tensor([[0, 1], [2, -1], [0, 3]])), ValueError, "found -1"),
        (dict(expert_weights=torch.zeros(3, 2, dtype=torch.long)), TypeError, "floating point"),
        (dict(expert_weights=torch.zeros(3, 3)), ValueError, "expert_weights must be"),
        (dict(w_gate_up=torch.zeros(4, 31, 32)), ValueError, "w_gate_up must be"),
        (dict(w_gate_up=torch.zeros(4, 32, 16)), ValueError, "w_gate_up must be"),
        (dict(w_down=torch.zeros(4, 32, 8)), ValueError, "w_down must be"),
        (dict(w_down=torch.zeros(4, 32, 16, dtype=torch.float16)), TypeError, "w_down must have hidden's dtype"),
        (dict(b_gate_up=torch.zeros(4, 16)), ValueError, "b_gate_up must be"),
        (dict(b_down=torch.zeros(4, 32, 1)), ValueError, "b_down must be"),
        (dict(out=torch.zeros(3, 31)), ValueError, "out must be"),
        (dict(out=torch.zeros(3, 32, dtype=torch.float64)), TypeError, "out must have hidden's dtype"),
        (dict(activation="relu"), ValueError, "activation must be one of"),
        (dict(limit=float("inf")), TypeError, "limit must be a finite float"),
        (dict(limit=-1.0), ValueError, "limit must be positive"),
        (dict(alpha="1"), TypeError, "alpha must be a finite float"),
        (dict(backend="cuda"), ValueError, "backend must be one of"),
        (dict(w_down=torch.zeros(4, 32, 16, device="meta")), ValueError, "one device"),
    ],
)
def test_bad_calls_are_refused(change, error, match):
    with pytest.raises(error, match=match):
        moe.experts(**{**_good(), **change})


def test_triton_refuses_float64():
    with pytest.raises(TypeError, match="not float64"):
        moe.experts(**_cast(_case(13, 2, 32, 16, 4, 1, biased=False), torch.float64), backend="triton")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_grouped_on_packed_weights_matches_reference(shape, dtype, tol):
    """The CPU path with each expert's weights packed for oneDNN (as `SparseMoE.prepare` packs them)."""
    seed, tokens, hidden, inter, num_experts, top_k, biased = shape
    case = _case(seed, tokens, hidden, inter, num_experts, top_k, biased=biased)
    cast = _cast(case, dtype, torch.device("cpu"))
    packed = [(cpu_linear.pack(g), cpu_linear.pack(d)) for g, d in zip(cast["w_gate_up"], cast["w_down"], strict=True)]
    assert all(p is not None for pair in packed for p in pair)
    got = moe.experts(**cast, activation="silu", backend="torch", packed=packed)
    torch.testing.assert_close(got.double(), _oracle(case, dtype, "silu"), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="packed holds"):
        moe.experts(**cast, activation="silu", backend="torch", packed=packed[:-1])
