"""A stand-in for `pagedkv/bench/peer_driver.py` without vLLM: the same JSON-lines protocol, greedy outputs from
transformers (which the engine matches token for token in float32), run by this interpreter.

FAKE_PEER_SWAP=ID:POS makes request ID take transformers' second most likely token at output position POS (greedy
again after it): a divergence the bench must find. FAKE_PEER_FAIL=load makes `load` fail.

For `--startup`: FAKE_PEER_LOAD=config makes `load` only read config.json (no transformers: fast) and take
FAKE_PEER_LOAD_S seconds (default 0.05); `fake_vllm_driver.py serve MODEL --port P ...` stands in for `vllm serve`:
an HTTP server whose /health answers 200 after FAKE_PEER_SERVE_DELAY seconds (default 0.2), until SIGTERM;
FAKE_PEER_FAIL=serve makes it exit 3 at once. Every load reply says which VLLM_CACHE_ROOT it had.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time


def serve(args: list[str]) -> int:
    import http.server
    import signal

    if os.environ.get("FAKE_PEER_FAIL") == "serve":
        print("fake vllm serve: asked to fail", file=sys.stderr)
        return 3
    model, port = args[0], int(args[args.index("--port") + 1])
    if not os.path.isfile(os.path.join(model, "config.json")):
        print(f"fake vllm serve: no config.json in {model}", file=sys.stderr)
        return 2
    ready_at = time.monotonic() + float(os.environ.get("FAKE_PEER_SERVE_DELAY", "0.2"))

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/health" and time.monotonic() >= ready_at
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Health)

    def stop(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever(poll_interval=0.05)
    server.server_close()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["serve"]:
        return serve(sys.argv[2:])
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
            if os.environ.get("FAKE_PEER_LOAD") == "config":
                started = time.perf_counter()
                with open(os.path.join(msg["model"], "config.json")) as f:
                    json.load(f)
                time.sleep(float(os.environ.get("FAKE_PEER_LOAD_S", "0.05")))
                eager = msg.get("enforce_eager", False)
                reply = {
                    "ok": True,
                    "load_s": time.perf_counter() - started,
                    "vllm": "fake",
                    "torch": "none",
                    "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto (unset)"),
                    "block_size": 16,
                    "compilation": "none" if eager else "fake compiled",
                    "cache_root": os.environ.get("VLLM_CACHE_ROOT"),
                }
                root = os.environ.get("VLLM_CACHE_ROOT")
                if root and not eager:  # a compile cache, as vLLM writes one
                    os.makedirs(os.path.join(root, "torch_compile_cache"), exist_ok=True)
                    with open(os.path.join(root, "torch_compile_cache", "artifact"), "w") as f:
                        f.write("compiled")
                replies.write(json.dumps(reply) + "\n")
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
