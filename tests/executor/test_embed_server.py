"""An executor process started with `--task embed` over the wire: `Embed` answered with pooled vectors equal to
transformers', `Submit` refused (`wrong_task`), and the other way round on a generating executor; the CLI's
embedding options checked."""

from __future__ import annotations

import subprocess
import sys
from array import array

import torch
import transformers

from common.tokens import pack_tokens
from executor import protocol as ep
from executor.params import SamplingParams
from tests.executor.harness import reference_run

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41]]


def _reply(client, request_id: str) -> ep.Outbound:
    while True:
        message = client.receive()
        if getattr(message, "request_id", None) == request_id:
            return message


def test_embed_executor_serves_embed_and_refuses_submit(tiny_models, blockd, start_executor) -> None:
    model_dir = tiny_models["llama"]
    executor = start_executor(model_dir, blockd.endpoint, "--task", "embed", "--pooling-type", "mean")
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with reference_run():
        expected = torch.stack([model(torch.tensor([p])).last_hidden_state[0].mean(0) for p in PROMPTS])
    with executor.client(timeout_s=10) as client:
        assert client.info().task == "embed"
        client.send_raw(ep.encode(ep.Embed(request_id="e", prompts=[pack_tokens(p) for p in PROMPTS])))
        answer = _reply(client, "e")
        assert type(answer) is ep.Embedded and answer.prompt_tokens == sum(map(len, PROMPTS))
        rows = []
        for vector in answer.embeddings:
            values = array("f")
            values.frombytes(vector)
            rows.append(values.tolist())
        got = torch.tensor(rows)
        torch.testing.assert_close(got, torch.nn.functional.normalize(expected, dim=-1), atol=1e-4, rtol=1e-4)
        # Three prompts of 300 tokens: three passes of at most the context (512) each. The load asked for right
        # after is answered between passes, before the vectors, and counts the request.
        long = [[(7 * i + j) % 500 + 1 for j in range(300)] for i in range(3)]
        client.send_raw(ep.encode(ep.Embed(request_id="long", prompts=[pack_tokens(p) for p in long])))
        client.send_raw(ep.encode(ep.GetLoad()))
        first = client.receive()
        assert type(first) is ep.LoadReport and first.running == 1, first
        answer = _reply(client, "long")
        assert type(answer) is ep.Embedded and len(answer.embeddings) == 3
        client.submit("g", [1, 2, 3], SamplingParams(max_tokens=2))
        refused = _reply(client, "g")
        assert type(refused) is ep.Rejected and refused.code == "wrong_task"


def test_generating_executor_refuses_embed(tiny_models, blockd, start_executor) -> None:
    executor = start_executor(tiny_models["llama"], blockd.endpoint)
    with executor.client(timeout_s=10) as client:
        assert client.info().task == "generate"
        client.send_raw(ep.encode(ep.Embed(request_id="e", prompts=[pack_tokens([1, 2])])))
        refused = _reply(client, "e")
        assert type(refused) is ep.Rejected and refused.code == "wrong_task" and "--task embed" in refused.message


def test_embedding_options_are_checked(tiny_models) -> None:
    base = [sys.executable, "-m", "executor.main", "--model", str(tiny_models["llama"])]
    for args, message in (
        (["--task", "generate", "--runner", "pooling"], "disagree"),
        (["--pooling-type", "mean"], "--task embed only"),
        (["--task", "embed", "--pooling-type", "max"], "--pooling-type"),
    ):
        done = subprocess.run(base + args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_a_failed_embedding_pass_fails_its_request_alone(tiny_models, blockd, start_executor) -> None:
    """An embedding pass that raises (here by fault injection, as an out-of-memory error would) answers its
    request `embedding_failed`, and the executor goes on serving: the next request gets its vectors."""
    executor = start_executor(tiny_models["llama"], blockd.endpoint, "--task", "embed", "--fault-embed-error", "1")
    with executor.client(timeout_s=10) as client:
        client.send_raw(ep.encode(ep.Embed(request_id="doomed", prompts=[pack_tokens(p) for p in PROMPTS])))
        failed = _reply(client, "doomed")
        assert type(failed) is ep.Rejected and failed.code == "embedding_failed", failed
        assert "RuntimeError" in failed.message
        client.send_raw(ep.encode(ep.Embed(request_id="after", prompts=[pack_tokens(p) for p in PROMPTS])))
        answer = _reply(client, "after")
        assert type(answer) is ep.Embedded and len(answer.embeddings) == len(PROMPTS)
        assert client.load().running == 0
