"""A stand-in for `pagedkv/bench/peer_driver.py` without vLLM: the same JSON-lines protocol, greedy outputs from
transformers (which the engine matches token for token in float32), run by this interpreter.

FAKE_PEER_SWAP=ID:POS makes request ID take transformers' second most likely token at output position POS (greedy
again after it): a divergence the bench must find. FAKE_PEER_FAIL=load makes `load` fail.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    model = None
    swap_id, _, swap_pos = os.environ.get("FAKE_PEER_SWAP", "").partition(":")
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        if op == "quit":
            replies.write(json.dumps({"ok": True}) + "\n")
            return 0
        if op == "load":
            if os.environ.get("FAKE_PEER_FAIL") == "load":
                replies.write(json.dumps({"ok": False, "error": "RuntimeError: asked to fail"}) + "\n")
                continue
            import torch
            import transformers

            torch.set_num_threads(1)  # the bench's own process computes too: no two OpenMP teams on each core
            model = transformers.AutoModelForCausalLM.from_pretrained(msg["model"], dtype=torch.float32).eval()
            reply = {
                "ok": True,
                "load_s": 0.0,
                "vllm": "fake",
                "torch": torch.__version__,
                "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto (unset)"),
                "block_size": 16,
                "compilation": "none",
            }
        elif op == "generate":
            import torch

            assert model is not None
            cpu0, t0 = time.process_time(), time.perf_counter()
            outputs = {}
            with torch.inference_mode():
                for r in msg["requests"]:
                    step, past, out = torch.tensor([r["prompt"]]), None, []
                    for position in range(r["output_len"]):
                        result = model(step, past_key_values=past, use_cache=True)
                        past = result.past_key_values
                        top = torch.topk(result.logits[0, -1], 2).indices.tolist()
                        token = top[1] if (r["id"] == swap_id and str(position) == swap_pos) else top[0]
                        out.append(token)
                        step = torch.tensor([[token]])
                    outputs[r["id"]] = out
            reply = {
                "ok": True,
                "outputs": outputs,
                "seconds": time.perf_counter() - t0,
                "cpu_s": time.process_time() - cpu0,
                "output_tokens": sum(len(o) for o in outputs.values()),
            }
        else:
            reply = {"ok": False, "error": f"unknown op {op!r}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
