"""`pagedkv-gateway`, the gateway's entry point: its options become a `GatewayConfig`, which gateway/server.py
serves. Every option can also be set by an environment variable (PAGEDKV_GATEWAY_ and its name in capitals)."""

from __future__ import annotations

import os
from pathlib import Path

import click
from click.core import ParameterSource

from blockd.protocol import DEFAULT_ENDPOINT as DEFAULT_BLOCKD
from common.auth import is_loopback
from common.clicks import client_keys, insecure_option, keys_option
from common.logs import configure_logging
from common.units import parse_size
from executor.protocol import DEFAULT_BIND as DEFAULT_EXECUTOR
from gateway import ROUTING_POLICIES, TOOL_CALL_PARSERS
from gateway.admission import DEFAULT_MAX_QUEUE_DELAY_S
from gateway.migration import DEFAULT_MAX_MIGRATIONS
from gateway.server import run_gateway

API_KEY_ENV = "PAGEDKV_GATEWAY_API_KEY"


def _endpoints(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[str, ...]:
    endpoints = tuple(e.strip() for e in value.split(",") if e.strip())
    if not endpoints:
        raise click.BadParameter("give at least one executor endpoint, like tcp://127.0.0.1:5560")
    bad = [e for e in endpoints if "://" not in e]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not a ZeroMQ endpoint (like tcp://host:5560)")
    if len(set(endpoints)) != len(endpoints):
        raise click.BadParameter("an executor endpoint is listed twice")
    return endpoints


@click.command(
    context_settings={
        "show_default": True,
        "help_option_names": ["-h", "--help"],
        "auto_envvar_prefix": "PAGEDKV_GATEWAY",
    }
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar="PAGEDKV_GATEWAY_MODEL",
    help="The model's directory, for its tokenizer and chat template (the executors load its weights). "
    "Default: the generated default model, created on first use.",
)
@click.option(
    "--executors",
    default=DEFAULT_EXECUTOR,
    callback=_endpoints,
    envvar="PAGEDKV_GATEWAY_EXECUTORS",
    help="Comma-separated ZeroMQ endpoints of the executors.",
)
@click.option(
    "--blockd",
    "blockd_endpoint",
    default=DEFAULT_BLOCKD,
    envvar="PAGEDKV_GATEWAY_BLOCKD",
    help="blockd's ZeroMQ endpoint (asked which executor holds a prompt's prefix).",
)
@click.option("--host", default="127.0.0.1", envvar="PAGEDKV_GATEWAY_HOST", help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    envvar="PAGEDKV_GATEWAY_PORT",
    help="HTTP port (0: any free port, printed at startup).",
)
@click.option(
    "--routing",
    type=click.Choice(ROUTING_POLICIES),
    default="prefix",
    envvar="PAGEDKV_GATEWAY_ROUTING",
    help="prefix: the executor holding the longest cached prefix unless it is much busier than the "
    "least loaded; least-loaded; round-robin.",
)
@click.option(
    "--load-slack",
    type=click.IntRange(min=0),
    default=8,
    envvar="PAGEDKV_GATEWAY_LOAD_SLACK",
    help="prefix routing: how many more requests in flight than the least-loaded executor a prefix "
    "holder may have and still be chosen.",
)
@click.option(
    "--served-model-name",
    default=None,
    envvar="PAGEDKV_GATEWAY_SERVED_MODEL_NAME",
    help="The model name clients ask for. Default: the model directory's name.",
)
@click.option(
    "--max-queued-sequences",
    type=click.IntRange(min=1),
    default=512,
    envvar="PAGEDKV_GATEWAY_MAX_QUEUED_SEQUENCES",
    help="Sequences (a request's prompts x n) in flight at once, waiting or generating; a request that would "
    "pass it gets 429, one that alone exceeds it 400 (too_many_generations).",
)
@click.option(
    "--max-queue",
    "deprecated_max_queue",
    type=click.IntRange(min=1),
    default=None,
    envvar="PAGEDKV_GATEWAY_MAX_QUEUE",
    hidden=True,
    help="Deprecated spelling of --max-queued-sequences.",
)
@click.option(
    "--executor-timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    envvar="PAGEDKV_GATEWAY_EXECUTOR_TIMEOUT",
    help="Seconds an executor may send nothing, not even the beacon it sends every 0.25 s from a thread of its "
    "own, before it is taken for dead and out of rotation (stretched, up to twice this, where its beacon is seen "
    "arriving late). A long step is not silence: its executor keeps its streams.",
)
@click.option(
    "--max-migrations",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_MIGRATIONS,
    envvar="PAGEDKV_GATEWAY_MAX_MIGRATIONS",
    help="Times a generation whose executor is lost mid-generation is continued on another executor, from its "
    "prompt and the tokens already generated, so that its stream goes on; past it, or 0, such a stream ends with "
    "an error event (a whole response starts over).",
)
@click.option(
    "--max-queue-delay",
    type=click.FloatRange(min=0),
    default=DEFAULT_MAX_QUEUE_DELAY_S,
    envvar="PAGEDKV_GATEWAY_MAX_QUEUE_DELAY",
    help="Seconds a new request may be expected to wait for the work queued before it (estimated from each "
    "executor's measured throughput); past it, new requests get 429 with Retry-After at once, and accepted ones "
    "are never failed for being slow. 0: no such bound.",
)
@click.option(
    "--max-body-bytes",
    default="4MiB",
    envvar="PAGEDKV_GATEWAY_MAX_BODY_BYTES",
    help="Largest request body accepted (bytes, or with a unit: 4MiB); a larger one gets 413 unread.",
)
@click.option(
    "--tool-call-parser",
    type=click.Choice(TOOL_CALL_PARSERS),
    default="auto",
    envvar="PAGEDKV_GATEWAY_TOOL_CALL_PARSER",
    help="How tool calls are found in the model's output (tool_choice 'auto'): hermes (<tool_call> JSON, "
    "Hermes and Qwen), llama3_json (Llama 3's JSON), none; auto: by the model's chat template.",
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    allow_from_autoenv=False,
    help="An API key clients must send (Authorization: Bearer KEY); repeat for several. Also "
    "PAGEDKV_GATEWAY_API_KEY (comma-separated) and --api-key-file. None: the API is open.",
)
@click.option(
    "--api-key-file",
    "api_key_files",
    multiple=True,
    allow_from_autoenv=False,
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="A file of API keys, one a line (# comments); repeatable.",
)
@click.option("--protect-health", is_flag=True, help="/health needs an API key too (by default it is open).")
@click.option("--protect-metrics", is_flag=True, help="/metrics needs an API key too (by default it is open).")
@click.option(
    "--report-cached-tokens",
    is_flag=True,
    help="Report usage.prompt_tokens_details.cached_tokens for every request. By default only requests with a "
    "cache_salt see it: for the others it would tell whether someone else sent the same prefix.",
)
@keys_option(
    "Key directory (`pagedkv keys generate DIR`) of a blockd and executors that serve CURVE: the gateway "
    "connects with its gateway key.",
)
@click.option("--key-name", default="gateway", help="Which key of --keys is this gateway's.")
@insecure_option("Allow --host beyond loopback without API keys (anyone who reaches the port may generate).")
@click.option(
    "--log-level",
    default="info",
    type=click.Choice(["debug", "info", "warning", "error"]),
    envvar="PAGEDKV_GATEWAY_LOG_LEVEL",
)
def main(
    model_dir: Path | None,
    executors: tuple[str, ...],
    blockd_endpoint: str,
    host: str,
    port: int,
    routing: str,
    load_slack: int,
    served_model_name: str | None,
    max_queued_sequences: int,
    deprecated_max_queue: int | None,
    executor_timeout: float,
    max_migrations: int,
    max_queue_delay: float,
    max_body_bytes: str,
    tool_call_parser: str,
    api_keys: tuple[str, ...],
    api_key_files: tuple[Path, ...],
    protect_health: bool,
    protect_metrics: bool,
    report_cached_tokens: bool,
    keys_dir: Path | None,
    key_name: str,
    insecure: bool,
    log_level: str,
) -> None:
    """Serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) in front of executors.

    Every option can also be set by an environment variable: PAGEDKV_GATEWAY_ and the option's name in capitals
    with underscores (PAGEDKV_GATEWAY_EXECUTORS, PAGEDKV_GATEWAY_PORT, ...)."""
    try:
        body_limit = parse_size(max_body_bytes)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-body-bytes") from None
    log = configure_logging("gateway", log_level)
    if deprecated_max_queue is not None:
        if click.get_current_context().get_parameter_source("max_queued_sequences") is not ParameterSource.DEFAULT:
            raise click.UsageError("give --max-queued-sequences only (--max-queue is its deprecated spelling)")
        log.warning(
            "deprecated_option",
            option="--max-queue (PAGEDKV_GATEWAY_MAX_QUEUE)",
            use="--max-queued-sequences (PAGEDKV_GATEWAY_MAX_QUEUED_SEQUENCES)",
        )
        max_queued_sequences = deprecated_max_queue
    from common.tokenizer_cache import TokenizerResolutionError
    from common.tokenizer_cache import resolve as resolve_tokenizer
    from gateway.auth import read_api_keys
    from gateway.state import GatewayConfig

    keys = read_api_keys(api_keys, os.environ.get(API_KEY_ENV), api_key_files)
    if not keys and not insecure and not is_loopback(host):
        raise click.UsageError(
            f"the gateway would listen on {host}, beyond loopback, without API keys: give --api-key, "
            f"{API_KEY_ENV} or --api-key-file, or --insecure to serve an open API anyway"
        )
    curve = client_keys(keys_dir, key_name)

    if model_dir is None:
        from common.default_model import ensure_default_model

        model_dir = ensure_default_model()
    try:  # the tokenizer as transformers resolves it, in a child process, before anything listens
        resolve_tokenizer(model_dir)
    except TokenizerResolutionError as exc:
        raise click.ClickException(str(exc)) from None
    config = GatewayConfig(
        model_dir=model_dir,
        executors=executors,
        blockd_endpoint=blockd_endpoint,
        routing=routing,
        load_slack=load_slack,
        served_model_name=served_model_name,
        max_queued_sequences=max_queued_sequences,
        executor_timeout_s=executor_timeout,
        max_migrations=max_migrations,
        max_queue_delay_s=max_queue_delay or None,
        max_body_bytes=body_limit,
        tool_call_parser=tool_call_parser,
        curve=curve,
        api_keys=keys,
        protect_health=protect_health,
        protect_metrics=protect_metrics,
        report_cached_tokens=report_cached_tokens,
    )
    run_gateway(config, host=host, port=port, log_level=log_level)


if __name__ == "__main__":  # pragma: no cover
    main()
