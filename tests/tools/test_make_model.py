"""`pagedkv make-model` and the checkpoint reader: the written directory behaves like a downloaded model."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from common.default_model import ensure_default_model
from executor.checkpoint import iter_weights, load_config, weight_files
from executor.model_config import CheckpointError, RopeConfig, UnsupportedModel
from executor.models.families import SUPPORTED_ARCHITECTURES
from pagedkv.tools.model_gen import ModelSpecError, write_model
from pagedkv.tools.model_gen.cli import make_model
from pagedkv.tools.model_gen.spec import ARCHITECTURES
from tests.support.models import TINY, TINY_ARCHS

TEXT = "héllo wörld 日本語 🙂"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
CHATML = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"


def file_hashes(model_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(model_dir.iterdir())}


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return dict(iter_weights(model_dir))


# ------------------------------------------------------------------------------------- transformers reads it


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_transformers_loads_every_weight_and_the_logits_are_peaked(tiny_models: dict[str, Path], arch: str) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(tiny_models[arch], output_loading_info=True)
    assert type(model).__name__ == {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    prompts = torch.randint(4, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(prompts).logits
        generated = model.generate(
            prompts[:2, :8], max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=1
        )[:, 8:]
    # Downstream greedy comparisons need well separated top-1/top-2 logits and a non-degenerate continuation.
    top2 = logits.topk(2, dim=-1).values
    assert logits.std(dim=-1).mean() > 2.0
    assert (top2[..., 0] - top2[..., 1]).median() > 0.2
    assert all(len(set(row.tolist())) >= 16 for row in generated)
    if arch == "qwen2":  # the q/k/v bias path must matter
        assert model.model.layers[0].self_attn.q_proj.bias.abs().min() > 0


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_no_family_echoes_its_input_or_saturates(arch: str, tmp_path: Path) -> None:
    """Every family's random model (its default tying) predicts from its context: tied Gemma, whose embedding is
    scaled by sqrt(hidden), once only echoed the input token with logprob 0, so comparisons hardly tested it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(write_model(tmp_path / arch, quiet=True, arch=arch, **TINY)).eval()
    prompt = torch.randint(4, 512, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(prompt).logits[0].float(), dim=-1)
    top2 = logprobs.topk(2, dim=-1).values
    assert (logprobs.argmax(-1) == prompt[0]).float().mean() < 0.2
    assert top2[:, 0].median() < -0.1  # not a certainty: the logprobs compared with transformers mean something
    assert (top2[:, 0] - top2[:, 1]).median() > 0.2


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tokenizer_round_trips_and_has_the_model_vocab(tiny_models: dict[str, Path], arch: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models[arch])
    assert len(tokenizer) == load_config(tiny_models[arch]).vocab_size == 512
    for text in (TEXT, "  indented\n\tcode = x[0] + 12345  # ok\n", "naïve café — “quoted” ✓"):
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
        # what the raw tokenizer.json does is what transformers does (a gateway may use either)
        assert Tokenizer.from_file(str(tiny_models[arch] / "tokenizer.json")).encode(text).ids == ids
    assert len(tokenizer(TEXT)["input_ids"]) < len(TEXT.encode())  # merges were learned
    assert tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
        3,
    ]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)


def test_chat_template_renders_chatml(tiny_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False) == CHATML
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt == CHATML + "<|im_start|>assistant\n"
    config = json.loads((tiny_models["llama"] / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]
    special = json.loads((tiny_models["llama"] / "special_tokens_map.json").read_text())
    assert special["eos_token"] == "<|end_of_text|>"


# -------------------------------------------------------------------------------------------- determinism


def test_same_seed_gives_identical_files_and_another_seed_other_weights(
    tiny_models: dict[str, Path], tiny_options: dict[str, Any], tmp_path: Path
) -> None:
    again = write_model(tmp_path / "again", arch="llama", quiet=True, **tiny_options)
    assert file_hashes(again) == file_hashes(tiny_models["llama"])
    other = write_model(tmp_path / "other", arch="llama", quiet=True, **{**tiny_options, "seed": 1})
    ours, theirs = weights(tiny_models["llama"]), weights(other)
    assert ours.keys() == theirs.keys()
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(ours[q_proj], theirs[q_proj])


def test_tokenizer_training_is_the_same_in_another_process() -> None:
    from pagedkv.tools.model_gen.tokenizer import _trained_tokenizer_json

    here = hashlib.sha256(_trained_tokenizer_json.__wrapped__(512, 0, False).encode()).hexdigest()
    code = (
        "import hashlib; from pagedkv.tools.model_gen.tokenizer import _trained_tokenizer_json as t; "
        "print(hashlib.sha256(t(512, 0, False).encode()).hexdigest())"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there


def test_sharded_save_holds_the_same_tensors(
    tiny_models: dict[str, Path], tiny_options: dict[str, Any], tmp_path: Path
) -> None:
    sharded = write_model(tmp_path / "sharded", arch="llama", max_shard_size="64KiB", quiet=True, **tiny_options)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = weight_files(sharded)
    assert len(files) > 1 and not (sharded / "model.safetensors").exists()
    assert {f.name for f in files} == set(index["weight_map"].values())
    single, split = weights(tiny_models["llama"]), weights(sharded)
    assert single.keys() == split.keys()
    assert all(torch.equal(single[name], split[name]) for name in single)


# -------------------------------------------------------------------------------------------- load_config


def test_load_config_reads_each_architecture(
    tiny_models: dict[str, Path], tiny_options: dict[str, Any], llama3_model: Path
) -> None:
    llama, qwen2, mistral = (load_config(tiny_models[a]) for a in ("llama", "qwen2", "mistral"))
    hidden = tiny_options["hidden_size"]
    intermediate = 16 * math.ceil(2.7 * hidden / 16)  # make-model's default
    assert (llama.architecture, llama.vocab_size, llama.hidden_size, llama.intermediate_size) == (
        "llama",
        512,
        hidden,
        intermediate,
    )
    assert (llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == (2, 4, 2, hidden // 4)
    assert (llama.rope_theta, llama.rope_scaling, llama.max_model_len) == (10000.0, None, 512)
    assert (llama.bos_token_id, llama.eos_token_ids, llama.torch_dtype) == (0, (1, 3), "float32")  # 3: im_end
    assert not llama.tie_word_embeddings and not llama.attention_bias
    assert qwen2.architecture == "qwen2" and qwen2.attention_bias and qwen2.tie_word_embeddings
    assert "lm_head.weight" not in weights(tiny_models["qwen2"])
    assert mistral.architecture == "mistral" and mistral.max_model_len == 512  # no sliding window
    assert load_config(llama3_model).rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }


def test_model_id_is_stable_and_follows_the_weights(
    tiny_models: dict[str, Path], tiny_options: dict[str, Any], tmp_path: Path
) -> None:
    model_id = load_config(tiny_models["llama"]).model_id
    assert model_id == load_config(tiny_models["llama"]).model_id
    assert model_id.startswith("tiny-llama-")
    twin = shutil.copytree(tiny_models["llama"], tmp_path / "a" / "tiny-llama")
    assert load_config(twin).model_id == model_id  # same files, same id
    other = write_model(tmp_path / "b" / "tiny-llama", arch="llama", quiet=True, **{**tiny_options, "seed": 1})
    assert load_config(other).model_id != model_id  # same config and sizes, other weights


def small_model() -> dict[str, Any]:
    return dict(hidden_size=64, heads=2, kv_heads=1, vocab_size=300, max_position=256)


def copy_with_config(src: Path, dst: Path, **changes: Any) -> Path:
    """A copy of a checkpoint whose config.json has `changes` applied (None deletes a key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_transformers4_spelling_and_sliding_windows(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    old = copy_with_config(
        tiny_models["llama"],
        tmp_path / "old",
        rope_parameters=None,
        dtype=None,
        torch_dtype="bfloat16",
        rope_theta=500000.0,
        rope_scaling={
            "type": "llama3",
            "factor": 8,
            "low_freq_factor": 1,
            "high_freq_factor": 4,
            "original_max_position_embeddings": 8192,
        },
    )
    config = load_config(old)
    assert (config.rope_theta, config.torch_dtype) == (500000.0, "bfloat16")
    assert config.rope_scaling is not None and config.rope_scaling["original_max_position_embeddings"] == 8192
    # A window is each layer's own and no longer caps the context: the model runs to its full length.
    windowed = load_config(copy_with_config(tiny_models["mistral"], tmp_path / "windowed", sliding_window=128))
    assert (windowed.max_model_len, windowed.sliding_windows) == (512, (128, 128))
    qwen = copy_with_config(
        tiny_models["qwen2"],
        tmp_path / "qwen",
        sliding_window=128,
        layer_types=None,
        use_sliding_window=True,
        max_window_layers=1,
    )
    assert load_config(qwen).sliding_windows == (None, 128)  # Qwen2 slides from layer max_window_layers on
    unused = copy_with_config(tiny_models["qwen2"], tmp_path / "unused", sliding_window=128)  # layer_types: full
    assert load_config(unused).sliding_windows == (None, None)
    # Gemma 3 as transformers 4 wrote it: two bases at the top level, a pattern instead of layer_types.
    gemma3 = write_model(tmp_path / "gemma3", arch="gemma3", quiet=True, layers=4, sliding_window=32, **small_model())
    old_gemma3 = copy_with_config(
        gemma3,
        tmp_path / "old-gemma3",
        rope_parameters=None,
        layer_types=None,
        rope_theta=500000.0,
        rope_local_base_freq=20000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=2,
    )
    config = load_config(old_gemma3)
    assert config.sliding_windows == (32, None, 32, None)
    assert config.rope("global") == RopeConfig(500000.0, {"rope_type": "linear", "factor": 8.0})
    assert config.rope("local") == RopeConfig(20000.0)


def test_unsupported_models_are_named(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    gpt2 = copy_with_config(
        tiny_models["llama"], tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2"
    )
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel") as caught:
        load_config(gpt2)
    assert all(name in str(caught.value) for name in SUPPORTED_ARCHITECTURES)
    refused = {
        "proportional": dict(rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0}),
        "partial_rotary_factor": dict(partial_rotary_factor=0.5),
        "mlp_bias": dict(mlp_bias=True),
        "quantization_config": dict(quantization_config={"quant_method": "mxfp4"}),
        "hidden_act": dict(hidden_act="gelu"),
        "final_logit_softcapping": dict(final_logit_softcapping=30.0),  # a Gemma field on a llama
        "use_bidirectional_attention": dict(use_bidirectional_attention=True),
        "shared_expert": dict(architectures=["Qwen3MoeForCausalLM"], shared_expert_intermediate_size=64),
    }
    for word, changes in refused.items():
        with pytest.raises(UnsupportedModel, match=word):
            load_config(copy_with_config(tiny_models["llama"], tmp_path / word, **changes))
    layer_types = copy_with_config(tiny_models["llama"], tmp_path / "layer-types", architectures=["Gemma2ForCausalLM"])
    config = json.loads((layer_types / "config.json").read_text())
    (layer_types / "config.json").write_text(json.dumps({**config, "layer_types": ["chunked_attention"] * 2}))
    with pytest.raises(UnsupportedModel, match="layer_types"):
        load_config(layer_types)


def test_missing_or_broken_files_raise_checkpoint_error(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=str(tmp_path / "config.json")):
        load_config(tmp_path)
    no_weights = shutil.copytree(tiny_models["llama"], tmp_path / "no-weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_config(no_weights)
    bad_index = shutil.copytree(tiny_models["llama"], tmp_path / "bad-index")
    (bad_index / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"gone\.safetensors"):
        weight_files(bad_index)
    (bad_index / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"index\.json"):
        list(iter_weights(bad_index))


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_help_and_a_run(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(make_model, ["--help"])
    assert result.exit_code == 0
    assert all(flag in result.output for flag in ("--arch", "--max-shard-size", "--seed", "--force"))
    out = tmp_path / "m"
    args = [
        "--arch",
        "qwen2",
        "--out",
        str(out),
        "--hidden-size",
        "64",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--vocab-size",
        "300",
        "--max-position",
        "64",
        "--dtype",
        "bfloat16",
    ]
    result = runner.invoke(make_model, args)
    assert result.exit_code == 0, result.output
    assert "qwen2" in result.output and "parameters" in result.output and "tokenizer.json" in result.output
    config = load_config(out)
    assert (config.architecture, config.vocab_size, config.torch_dtype) == ("qwen2", 300, "bfloat16")
    assert next(iter_weights(out))[1].dtype == torch.bfloat16


def test_cli_refuses_a_non_empty_dir_and_bad_values(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    runner = CliRunner()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    small = ["--hidden-size", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--vocab-size", "300"]
    result = runner.invoke(make_model, ["--out", str(taken), *small])
    assert result.exit_code == 2 and "not empty" in result.output and "--force" in result.output
    result = runner.invoke(make_model, ["--out", str(taken), "--force", *small])
    assert result.exit_code == 2 and "config.json" in result.output  # --force only replaces a model
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    model = shutil.copytree(tiny_models["mistral"], tmp_path / "model")
    assert runner.invoke(make_model, ["--out", str(model), "--force", *small]).exit_code == 0
    assert load_config(model).architecture == "llama"

    bad = {
        ("--dtype", "int8"): "int8",
        ("--kv-heads", "3"): "kv heads do not divide",
        ("--heads", "5"): "do not divide --hidden-size",
        ("--vocab-size", "100"): "256 byte tokens",
        ("--max-shard-size", "lots"): "size",
        ("--head-dim", "48"): "not one the kernels support",
    }
    for (flag, value), message in bad.items():
        result = runner.invoke(make_model, ["--out", str(tmp_path / "never"), "--heads", "4", flag, value])
        assert result.exit_code == 2 and message in result.output, (flag, result.output)
    assert not (tmp_path / "never").exists()


def test_default_model_is_generated_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_HOME", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / "models" / "v2" / "default-llama"
    config = load_config(path)
    assert (config.architecture, config.hidden_size, config.num_layers, config.vocab_size) == ("llama", 256, 4, 4096)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == ["default-llama"]  # no staging directory left behind
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="no complete model"):
        ensure_default_model(broken)


# ---------------------------------------------------------------------------------------------- the families


def test_every_family_is_written_and_read_with_its_options(tmp_path: Path) -> None:
    small = dict(hidden_size=64, layers=2, heads=2, kv_heads=1, vocab_size=300, max_position=256, quiet=True)
    configs = {
        arch: load_config(write_model(tmp_path / arch, arch=arch, **{**small, **extra}))
        for arch, extra in {
            "qwen3": dict(head_dim=64, tie_embeddings=True),
            "qwen3_moe": dict(experts=4, experts_per_token=2, mlp_only_layers=(0,), norm_topk_prob=False),
            "mixtral": dict(experts=3, experts_per_token=1, sliding_window=40),
            "gemma2": dict(sliding_window=32),
            "gemma3": dict(layers=3, sliding_window=16, sliding_pattern=3),
            "phi3": dict(rope_scaling="longrope"),
            "gpt_oss": dict(sliding_window=8, rope_scaling="yarn"),
        }.items()
    }
    assert set(SUPPORTED_ARCHITECTURES.values()) >= set(configs) | set(TINY_ARCHS)
    qwen3 = configs["qwen3"]
    assert qwen3.qk_norm and qwen3.tie_word_embeddings and qwen3.head_dim == 64  # heads x head_dim != hidden
    moe = configs["qwen3_moe"]
    assert moe.moe is not None and (moe.moe.num_experts, moe.moe.top_k, moe.moe.norm_topk_prob) == (4, 2, False)
    assert [moe.layer(i).moe for i in range(2)] == [False, True]  # mlp_only_layers keeps layer 0 dense
    mixtral = configs["mixtral"]
    assert mixtral.moe is not None and mixtral.moe.norm_topk_prob and mixtral.sliding_windows == (40, 40)
    gemma2 = configs["gemma2"]
    assert (gemma2.sliding_windows, gemma2.attn_softcap, gemma2.final_softcap) == ((32, None), 50.0, 30.0)
    assert gemma2.norm_offset and gemma2.sandwich_norms and gemma2.embed_scale and gemma2.hidden_act == "gelu_tanh"
    assert gemma2.attention_scale == 256**-0.5 and gemma2.tie_word_embeddings
    gemma3 = configs["gemma3"]
    assert gemma3.sliding_windows == (16, 16, None) and [gemma3.layer(i).rope for i in range(3)] == [
        "local",
        "local",
        "global",
    ]
    assert (gemma3.rope("local").theta, gemma3.rope("global").theta) == (10000.0, 1000000.0)
    phi3 = configs["phi3"]
    assert phi3.rope_scaling is not None and phi3.rope_scaling["rope_type"] == "longrope"
    assert len(phi3.rope_scaling["short_factor"]) == phi3.head_dim // 2
    oss = configs["gpt_oss"]
    assert oss.attention_sinks and oss.attention_bias and oss.output_bias and oss.sliding_windows == (8, None)
    assert oss.moe is not None and (oss.moe.router, oss.moe.activation, oss.moe.expert_bias) == (
        "topk_softmax",
        "swiglu_oai",
        True,
    )
    assert oss.rope_scaling is not None and oss.rope_scaling["rope_type"] == "yarn"
    assert all(c.max_model_len == 256 for c in configs.values())  # no window caps the context


def test_family_options_are_checked(tmp_path: Path) -> None:
    bad = {
        ("llama", "sliding_window", 16): "--sliding-window",
        ("mistral", "sliding_pattern", 2): "--sliding-pattern",
        ("mixtral", "experts_per_token", 5): "--experts-per-token",
        ("qwen3_moe", "mlp_only_layers", (7,)): "--mlp-only-layers",
        ("phi3", "rope_scaling", "yarn"): "--rope-scaling",
    }
    for (arch, option, value), flag in bad.items():
        with pytest.raises(ModelSpecError) as caught:
            write_model(tmp_path / "never", arch=arch, quiet=True, **{option: value})
        assert caught.value.option == flag, (arch, option)
    assert not (tmp_path / "never").exists()


def test_cli_family_options(tmp_path: Path) -> None:
    runner = CliRunner()
    small = ["--hidden-size", "64", "--layers", "3", "--heads", "2", "--kv-heads", "1", "--vocab-size", "300"]
    out = tmp_path / "moe"
    args = ["--arch", "qwen3_moe", "--out", str(out), *small, "--experts", "3", "--experts-per-token", "2"]
    result = runner.invoke(make_model, [*args, "--mlp-only-layers", "0,2", "--sliding-window", "24"])
    assert result.exit_code == 0, result.output
    assert "3 experts, 2 per token" in result.output and "sliding window 24" in result.output
    config = load_config(out)
    assert [config.layer(i).moe for i in range(3)] == [False, True, False] and config.sliding_windows == (24,) * 3
    result = runner.invoke(make_model, [*args, "--force", "--mlp-only-layers", "first"])
    assert result.exit_code == 2 and "--mlp-only-layers" in result.output
    result = runner.invoke(
        make_model, ["--arch", "gemma3", "--out", str(tmp_path / "g"), *small, "--rope-scaling", "x"]
    )
    assert result.exit_code == 2 and "rope-scaling" in result.output
