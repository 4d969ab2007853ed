"""A stand-in for `pagedkv/bench/vllm_cli.py` without vLLM (standard library only), run by this interpreter.

- `serve MODEL --port P --served-model-name NAME ...`: a minimal OpenAI-compatible server on 127.0.0.1:P (GET
  /health and /v1/models; POST /v1/chat/completions streaming, one chunk of text per token, then the usage chunk;
  POST /v1/completions of token-id prompts streaming their `token_ids`, then the usage with the cached prompt
  tokens of a prefix cache that never evicts, as `pagedkv bench tiers` reads them) with a child process beside it
  (as vLLM's engine core), which must go when the bench stops the server.
- `bench serve ...`: a minimal `vllm bench serve`: the flags the bench passes, streamed chat completions at the
  given concurrency or Poisson rate, and a result JSON with the keys (and meaning) of vLLM's.

FAKE_VLLM_RECORD=FILE: every invocation appends {"argv", "env", "cwd", "child"} as one JSON line.
FAKE_VLLM_FAIL=serve | bench: that command fails at once (exit 3) after printing a recognisable error.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOKEN_S = 0.002  # the fake server's time per output token


def record(extra: dict[str, Any] | None = None) -> None:
    path = os.environ.get("FAKE_VLLM_RECORD")
    if not path:
        return
    env = {k: os.environ.get(k) for k in ("VLLM_TARGET_DEVICE", "VLLM_CPU_OMP_THREADS_BIND", "PYTHONPATH")}
    with open(path, "a") as f:
        f.write(json.dumps({"argv": sys.argv[1:], "env": env, "cwd": os.getcwd(), **(extra or {})}) + "\n")


def fail_if_asked(command: str) -> None:
    if os.environ.get("FAKE_VLLM_FAIL") == command:
        print(f"RuntimeError: fake vLLM asked to fail in {command}", flush=True)
        sys.exit(3)


# ---------------------------------------------------------------------------------------------------- serve


def serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--block-size", default="16")
    args, _ = parser.parse_known_args(argv)
    fail_if_asked("serve")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    record({"child": child.pid})
    name = args.served_model_name
    cache = PrefixCache(int(args.block_size))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_: Any) -> None:
            pass

        def _json(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            if self.path == "/v1/completions" and body.get("model") == name:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in completion_chunks(body, cache):
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                return
            if self.path != "/v1/chat/completions" or body.get("model") != name:
                self._json(404, {"error": f"no {body.get('model')} at {self.path}"})
                return
            tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages", []))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()

            def send(payload: Any) -> None:
                self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
                self.wfile.flush()

            time.sleep(TOKEN_S * 4)  # the prefill
            send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for _ in range(tokens):
                time.sleep(TOKEN_S)
                send({"choices": [{"index": 0, "delta": {"content": " x"}}]})
            usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
            send({"choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 256  # the listen backlog: 5 by default, less than one load's burst

    server = Server((args.host, args.port), Handler)
    print(f"fake vLLM serving {name} on {args.host}:{args.port}", flush=True)
    try:
        server.serve_forever()
    finally:
        child.kill()
    return 0


class PrefixCache:
    """Every computed full block of every sequence, never evicted; a hit leaves the prompt's last token out."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.blocks, self.lock = block_size, set(), threading.Lock()

    def hit(self, prompt: list[int]) -> int:
        with self.lock:
            n = 0
            while (n + 1) * self.block_size <= len(prompt) - 1 and tuple(
                prompt[: (n + 1) * self.block_size]
            ) in self.blocks:
                n += 1
            return n * self.block_size

    def computed(self, tokens: list[int]) -> None:
        with self.lock:
            self.blocks.update(
                tuple(tokens[: (i + 1) * self.block_size]) for i in range(len(tokens) // self.block_size)
            )


def completion_chunks(body: dict[str, Any], cache: PrefixCache) -> list[dict[str, Any]]:
    """A streamed completion of a token-id prompt: one token per chunk (a function of the prompt, as greedy decoding
    is), the finish reason, then the usage."""
    prompt = [int(t) for t in body["prompt"]]
    tokens = [4 + (sum(prompt) + 7 * i) % 400 for i in range(int(body.get("max_tokens") or 16))]
    cached = cache.hit(prompt)
    cache.computed(prompt + tokens[:-1])
    chunks: list[dict[str, Any]] = [{"choices": [{"index": 0, "text": " x", "token_ids": [t]}]} for t in tokens]
    chunks.append({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    usage = {"prompt_tokens": len(prompt), "completion_tokens": len(tokens), "total_tokens": len(prompt) + len(tokens)}
    chunks.append({"choices": [], "usage": usage | {"prompt_tokens_details": {"cached_tokens": cached}}})
    return chunks


# ----------------------------------------------------------------------------------------------- bench serve


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def one_request(url: str, model: str, prompt: str, output_len: int, ignore_eos: bool) -> dict[str, Any]:
    parts = urllib.parse.urlsplit(url)
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_completion_tokens": output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    out: dict[str, Any] = {"success": False, "ttft": 0.0, "itl": [], "latency": 0.0, "output_tokens": 0, "error": ""}
    started = last = time.perf_counter()
    try:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
        conn.request("POST", parts.path, json.dumps(payload), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            out["error"] = f"HTTP {response.status}: {response.read()[:300]!r}"
            return out
        first = False
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            now = time.perf_counter()
            if data.get("choices"):
                if not first:
                    first, out["ttft"] = True, now - started
                else:
                    out["itl"].append(now - last)
                last = now
            elif data.get("usage"):
                out["output_tokens"] = data["usage"].get("completion_tokens") or 0
        out["latency"] = last - started
        out["success"] = first
        if not first:
            out["error"] = "no chunk"
    except Exception as exc:  # a failed request, as vLLM's client counts it
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def bench_serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    for flag in (
        "--backend",
        "--base-url",
        "--endpoint",
        "--model",
        "--tokenizer",
        "--dataset-name",
        "--percentile-metrics",
        "--metric-percentiles",
        "--result-dir",
        "--result-filename",
        "--request-rate",
    ):
        parser.add_argument(flag, required=True)
    for flag in ("--random-input-len", "--random-output-len", "--num-prompts", "--seed", "--num-warmups"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--max-concurrency", type=int, default=None)
    for flag in ("--ignore-eos", "--save-result", "--save-detailed", "--disable-tqdm"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    record()
    fail_if_asked("bench")
    assert args.backend == "openai-chat" and args.dataset_name == "random"
    rng = random.Random(args.seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    prompts = [" ".join(rng.choices(words, k=args.random_input_len)) for _ in range(args.num_prompts)]
    url = args.base_url + args.endpoint
    rate = float(args.request_rate)
    workers = args.max_concurrency or args.num_prompts
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(workers, args.num_warmups, 1)) as pool:
        warm = [
            pool.submit(one_request, url, args.model, prompts[0], args.random_output_len, args.ignore_eos)
            for _ in range(args.num_warmups)
        ]
        for future in warm:
            future.result()
        gate = threading.Semaphore(workers)

        def limited(prompt: str) -> dict[str, Any]:
            with gate:
                return one_request(url, args.model, prompt, args.random_output_len, args.ignore_eos)

        started = time.perf_counter()
        futures = []
        for prompt in prompts:
            futures.append(pool.submit(limited, prompt))
            if rate != float("inf"):
                time.sleep(rng.expovariate(rate))
        outputs = [f.result() for f in futures]
        duration = time.perf_counter() - started
    good = [o for o in outputs if o["success"]]
    ttfts = [o["ttft"] * 1000 for o in good]
    tpots = [(o["latency"] - o["ttft"]) / (o["output_tokens"] - 1) * 1000 for o in good if o["output_tokens"] > 1]
    itls = [x * 1000 for o in good for x in o["itl"]]
    e2els = [o["latency"] * 1000 for o in good]
    total_output = sum(o["output_tokens"] for o in good)
    result: dict[str, Any] = {
        "backend": args.backend,
        "model_id": args.model,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "duration": duration,
        "completed": len(good),
        "failed": len(outputs) - len(good),
        "total_input_tokens": args.random_input_len * len(good),
        "total_output_tokens": total_output,
        "request_throughput": len(good) / duration,
        "request_goodput": None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_output + args.random_input_len * len(good)) / duration,
        "output_lens": [o["output_tokens"] for o in outputs],
        "errors": [o["error"] for o in outputs],
        "ttfts": [o["ttft"] for o in outputs],
    }
    for metric, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result[f"mean_{metric}_ms"] = statistics.fmean(values) if values else 0.0
        result[f"median_{metric}_ms"] = statistics.median(values) if values else 0.0
        result[f"p99_{metric}_ms"] = percentile(values, 99)
    os.makedirs(args.result_dir, exist_ok=True)
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(result, f)
    print(f"fake vllm bench serve: {len(good)}/{len(outputs)} ok, {total_output / duration:.1f} tok/s", flush=True)
    return 0


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    if argv[:2] == ["bench", "serve"]:
        return bench_serve(argv[2:])
    print(f"fake vLLM: unknown command {argv}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
