"""compose/: the Docker Compose deployment, checked as compose itself reads it.

`docker compose config` (the Compose v2 CLI; no engine needed) resolves the files, overrides and variables, and
every pagedkv command in the result (service commands and healthchecks) is parsed by the real click command
behind its console script in pyproject.toml, under the service's own environment. So a renamed flag, an
environment variable no option reads, endpoints that disagree or a variable missing from .env.example fail here,
not at `compose up`. Where `docker compose` is not installed, those tests skip and say so. `make compose-test`
(tests/compose/compose_e2e.py) builds the image and runs the stack for real.

Each check is a function returning a list of problems, so the negative tests can show it catches a broken file.
"""

from __future__ import annotations

import copy
import functools
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import click
import pytest
import yaml
from click.core import ParameterSource

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
CPU_FILE = COMPOSE_DIR / "docker-compose.cpu.yml"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
README = COMPOSE_DIR / "README.md"

IMAGE = "pagedkv:latest"
CPU_IMAGE = "pagedkv:cpu"
SERVICE_SCRIPTS = ("blockd", "pagedkv-executor", "pagedkv-gateway")
# Variables with these prefixes are meant for a pagedkv CLI: each must reach an option of the service's command.
CLI_ENV_PREFIXES = ("PAGEDKV_EXECUTOR_", "PAGEDKV_GATEWAY_", "BLOCKD_")
MODEL_MOUNT = "/models/model"
# The shared KV tier: one named volume every executor mounts here, in use once SHARED_KV_SIZE is set.
SHARED_KV_MOUNT = "/var/lib/pagedkv/shared-kv"
SHARED_KV_VOLUME = "shared-kv"
GPU = (COMPOSE_FILE,)
CPU = (COMPOSE_FILE, CPU_FILE)
CPU_PROFILES = ("executor-2",)  # the CPU file's on-demand third executor

Compose = dict[str, Any]


# ------------------------------------------------------------------------------------------ docker compose


class ComposeRefused(Exception):
    """`docker compose config` exited non-zero; the message is its stderr."""


# Where `docker compose` is not installed, `make compose-cli` (part of make test) puts the standalone Compose v2
# binary here.
STANDALONE = ROOT / ".compose-cli" / "docker-compose"


def _compose_command() -> tuple[list[str] | None, str]:
    """How to run Compose v2 here (`docker compose`, or the standalone binary), or None and why not."""
    why = "the docker CLI is not installed"
    for command in (["docker", "compose"], [str(STANDALONE)]):
        try:
            result = subprocess.run(
                [*command, "version", "--short"], capture_output=True, text=True, timeout=30, check=False
            )
        except (FileNotFoundError, PermissionError):
            continue
        if result.returncode == 0 and result.stdout.strip().lstrip("v").startswith("2"):
            return command, ""
        if command[0] == "docker":
            first = (result.stderr.strip().splitlines() or ["no output"])[0]
            why = f"`docker compose` (the Compose v2 CLI plugin) is not installed ({first[:120]})"
    return None, f"{why}, nor {STANDALONE.relative_to(ROOT)} (`make compose-cli` fetches it)"


COMPOSE, _WHY_NO_COMPOSE = _compose_command()


def _compose_missing() -> str | None:
    """Why `docker compose config` cannot run here, or None."""
    return None if COMPOSE is not None else _WHY_NO_COMPOSE


COMPOSE_MISSING = _compose_missing()
needs_compose = pytest.mark.skipif(COMPOSE_MISSING is not None, reason=str(COMPOSE_MISSING))


def _base_env() -> dict[str, str]:
    """Only what the docker CLI needs to find itself and its plugins: none of the caller's compose variables."""
    keep = ("PATH", "HOME", "DOCKER_CONFIG", "DOCKER_HOST", "DOCKER_CONTEXT", "XDG_RUNTIME_DIR")
    return {k: os.environ[k] for k in keep if k in os.environ}


def docker_compose(
    files: Sequence[Path],
    args: Sequence[str],
    env: Mapping[str, str] = {},
    *,
    env_file: Path | None = None,
    profiles: Sequence[str] = (),
) -> str:
    """stdout of `docker compose -f ... [--profile ...] <args>` with exactly `env` (and env_file, not compose/.env)."""
    assert COMPOSE is not None, _WHY_NO_COMPOSE
    command = [*COMPOSE, "--env-file", str(env_file or os.devnull)]
    for file in files:
        command += ["-f", str(file)]
    for profile in profiles:
        command += ["--profile", profile]
    result = subprocess.run(
        [*command, *args],
        env={**_base_env(), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    if result.returncode != 0:
        raise ComposeRefused(result.stderr.strip())
    return result.stdout


def read_env_file(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(NAME -> value, NAME -> the comment line right above it) of a KEY=VALUE file like compose's --env-file."""
    values: dict[str, str] = {}
    comments: dict[str, str] = {}
    previous = ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            name, sep, value = stripped.partition("=")
            assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name), f"{path.name}:{number}: not NAME=VALUE"
            assert name not in values, f"{path.name}:{number}: {name} is set twice"
            values[name] = value
            if previous.startswith("#"):
                comments[name] = previous.lstrip("# ")
        previous = stripped
    return values, comments


RAW_TEXT = COMPOSE_FILE.read_text()
EXAMPLE, EXAMPLE_COMMENTS = read_env_file(ENV_EXAMPLE)


def required_variables(files: Sequence[Path], profiles: Sequence[str] = ()) -> dict[str, str]:
    """The variables compose refuses to run without (`${NAME:?...}`), each with .env.example's value: found by
    asking compose with nothing set, adding the variable it names, and asking again."""
    env: dict[str, str] = {}
    while True:
        try:
            docker_compose(files, ["config", "--quiet"], env, profiles=profiles)
            return env
        except ComposeRefused as exc:
            missing = re.search(r"required variable (\w+) is missing a value", str(exc))
            if not missing or missing[1] in env:
                raise
            name = missing[1]
            assert name in EXAMPLE, f"compose requires ${{{name}}}, which .env.example does not list"
            env[name] = EXAMPLE[name]


def config_variables(files: Sequence[Path], profiles: Sequence[str] = ()) -> dict[str, str | None]:
    """Every variable the files read -> its default in them (None: required, no default), as compose lists them."""
    required = required_variables(files, profiles)
    out = docker_compose(files, ["config", "--variables"], required, profiles=profiles)
    header, *lines = out.splitlines()
    # NAME REQUIRED DEFAULT ALTERNATE, aligned under the header: read by column, since an empty default leaves
    # its column blank and a `${NAME:+VALUE}` fills ALTERNATE.
    default_at, alternate_at = header.index("DEFAULT VALUE"), header.index("ALTERNATE VALUE")
    variables: dict[str, str | None] = {}
    for line in (line for line in lines if line.strip()):
        name, required_column = line.split()[:2]
        variables[name] = None if required_column == "true" else line[default_at:alternate_at].strip()
    # A ${NAME:?} in a long-syntax volume is not listed by every compose version: the probe above found it.
    for name in required:
        variables[name] = None
    return variables


@functools.cache
def _config(files: tuple[Path, ...], profiles: tuple[str, ...], example: bool) -> str:
    required = required_variables(files, profiles)
    if example:
        return docker_compose(files, ["config", "--format", "json"], env_file=ENV_EXAMPLE, profiles=profiles)
    return docker_compose(files, ["config", "--format", "json"], required, profiles=profiles)


def load_compose(files: Sequence[Path] = GPU, profiles: Sequence[str] = (), *, example: bool = False) -> Compose:
    """The files as compose runs them with nothing but the required variables set (or with all of
    .env.example's), every profile given active."""
    if COMPOSE_MISSING:
        pytest.skip(COMPOSE_MISSING)
    return json.loads(_config(tuple(files), tuple(profiles), example))


# ---------------------------------------------------------------------------------------- the real commands


@functools.cache
def console_scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@functools.cache
def load_script(script: str) -> click.Command:
    """The click command behind a console script, found the way the installed entry point finds it."""
    module_name, _, attr = console_scripts()[script].partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    assert isinstance(target, click.Command), f"{script} -> {console_scripts()[script]} is not a click command"
    return target


class CheckError(Exception):
    pass


def _remaining_args(ctx: click.Context) -> list[str]:
    """What a group left for its subcommand (click >= 8.2 keeps the name apart; older ones in protected_args)."""
    protected = getattr(ctx, "_protected_args", None)
    return [*(ctx.protected_args if protected is None else protected), *ctx.args]


SECRETS_MOUNT = "/run/secrets/"
MAKE_SECRETS = COMPOSE_DIR / "make-secrets.sh"


@functools.cache
def secrets_standin() -> Path:
    """compose/make-secrets.sh run into a temporary directory (with this environment's `pagedkv`): what the
    containers find under /run/secrets, so options that want an existing file see one. Its `keys` (the whole key
    set) stands in for each service's own key directory."""
    directory = Path(tempfile.mkdtemp(prefix="pagedkv-compose-test-")) / "secrets"
    pagedkv = shutil.which("pagedkv") or str(Path(sys.executable).parent / "pagedkv")
    subprocess.run(
        ["sh", str(MAKE_SECRETS), str(directory)],
        env={**os.environ, "PAGEDKV": pagedkv},
        check=True,
        capture_output=True,
        timeout=120,
    )
    return directory


def _on_host(value: str) -> str:
    """A /run/secrets/ path as the stand-in directory holds it; anything else unchanged."""
    if value.startswith(SECRETS_MOUNT):
        return str(secrets_standin() / value.removeprefix(SECRETS_MOUNT))
    return value


def parse_argv(argv: list[str], env: Mapping[str, str]) -> list[click.Context]:
    """Parse `argv` (console script first) with the real click command under exactly `env`, as the process in
    the container would; returns the command's context, then each subcommand's. Raises click's own errors.
    Paths under /run/secrets/ are read from secrets_standin()."""
    script, args = argv[0], [_on_host(a) for a in argv[1:]]
    env = {k: _on_host(v) for k, v in env.items()}
    if script not in console_scripts():
        raise CheckError(
            f"{script!r} is not a console script in pyproject.toml [project.scripts] "
            f"({', '.join(sorted(console_scripts()))})"
        )
    command = load_script(script)
    with mock.patch.dict(os.environ, env, clear=True):
        contexts = [command.make_context(script, args)]
        while isinstance(command, click.Group):
            rest = _remaining_args(contexts[-1])
            if not rest:
                raise click.UsageError(f"{script} needs a command ({', '.join(command.list_commands(contexts[-1]))})")
            name, sub, rest = command.resolve_command(contexts[-1], rest)
            assert name is not None and sub is not None
            command = sub
            contexts.append(command.make_context(name, rest, parent=contexts[-1]))
    return contexts


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):  # the KEY=VALUE list form
        env = dict(item.partition("=")[::2] for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def pagedkv_services(compose: Compose, *images: str) -> dict[str, dict[str, Any]]:
    """The services running a pagedkv image (the GPU or the CPU one, unless `images` names some)."""
    wanted = images or (IMAGE, CPU_IMAGE)
    return {name: s for name, s in compose["services"].items() if s.get("image") in wanted}


def services_running(compose: Compose, script: str) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in pagedkv_services(compose).items() if (s.get("command") or [None])[0] == script}


def healthcheck_argv(service: Mapping[str, Any]) -> list[str] | None:
    test = (service.get("healthcheck") or {}).get("test")
    return list(test[1:]) if isinstance(test, list) and test and test[0] == "CMD" else None


def _refusal(exc: BaseException) -> str:
    if isinstance(exc, click.ClickException):
        return f"{type(exc).__name__}: {exc.format_message()}"
    return f"{type(exc).__name__}: {exc}"  # click's Exit (--help), or our CheckError


def parse_service(name: str, service: Mapping[str, Any]) -> list[click.Context]:
    command = service.get("command")
    if not (isinstance(command, list) and command and all(isinstance(a, str) for a in command)):
        raise CheckError(f"{name}: command must be a list of strings (exec form), not {command!r}")
    return parse_argv(command, environment(service))


# -------------------------------------------------------------------------------------------------- checkers


def check_commands(compose: Compose) -> list[str]:
    """Every pagedkv service runs one of the service console scripts with flags and environment it accepts."""
    problems: list[str] = []
    for name, service in pagedkv_services(compose).items():
        command = service.get("command")
        script = command[0] if isinstance(command, list) and command else None
        if script not in SERVICE_SCRIPTS:
            problems.append(f"{name}: command {command!r} does not run one of {', '.join(SERVICE_SCRIPTS)}")
        try:
            ctx: click.Context | None = parse_service(name, service)[0]
        except (click.ClickException, click.exceptions.Exit, CheckError) as exc:
            problems.append(f"{name}: {command!r} is refused: {_refusal(exc)}")
            ctx = None
        if script in console_scripts():  # variable by variable, so a refused value is named
            problems += _check_environment(name, service, ctx)
        probe = healthcheck_argv(service)
        if probe is not None and probe[0] in console_scripts():
            try:
                parse_argv(probe, environment(service))
            except (click.ClickException, click.exceptions.Exit, CheckError) as exc:
                problems.append(f"{name}: healthcheck {probe!r} is refused: {_refusal(exc)}")
    return problems


def _check_environment(name: str, service: Mapping[str, Any], ctx: click.Context | None) -> list[str]:
    """Each CLI variable is read by an option (asked of click itself: set only it, see which option took it),
    with a value the option accepts, and no flag in the command (parsed as `ctx`) silently overrides it."""
    problems: list[str] = []
    script = service["command"][0]
    for var, value in environment(service).items():
        if not var.startswith(CLI_ENV_PREFIXES):
            continue
        if value == "":
            problems += _check_empty_variable(name, script, var, ctx)
            continue
        try:
            alone = parse_argv([script], {var: value})[0]
        except (click.ClickException, CheckError) as exc:
            problems.append(f"{name}: {var}={value!r} is refused by {script}: {_refusal(exc)}")
            continue
        options = [
            p.name
            for p in alone.command.params
            if p.name and alone.get_parameter_source(p.name) is ParameterSource.ENVIRONMENT
        ]
        if not options:
            problems.append(f"{name}: {var} is not read by any option of {script}")
        for option in options:
            if ctx is not None and ctx.get_parameter_source(option) is not ParameterSource.ENVIRONMENT:
                problems.append(f"{name}: {var} is overridden by a flag for {option!r} in the command")
    return problems


def _check_empty_variable(name: str, script: str, var: str, ctx: click.Context | None) -> list[str]:
    """An empty variable (a `${NAME:+VALUE}` or `${NAME:-}` with NAME unset) is unset to click, so there is no
    value to check: only that an option reads that name (click's own lookup, given a stand-in value) and that no
    flag in the command sets the option, which would make the variable pointless once it has a value."""
    command = load_script(script)
    with mock.patch.dict(os.environ, {}, clear=True):
        bare = command.make_context(script, [])
    with mock.patch.dict(os.environ, {var: "stand-in"}, clear=True):
        options = [p.name for p in command.params if p.name and p.resolve_envvar_value(bare) is not None]
    problems = [] if options else [f"{name}: {var} is not read by any option of {script}"]
    for option in options:
        if ctx is not None and ctx.get_parameter_source(option) is ParameterSource.COMMANDLINE:
            problems.append(f"{name}: {var} is overridden by a flag for {option!r} in the command")
    return problems


def _endpoint(value: str) -> tuple[str, int]:
    parts = urlsplit(value)
    if parts.scheme != "tcp" or not parts.hostname or parts.port is None:
        raise CheckError(f"{value!r} is not a tcp://host:port endpoint")
    return parts.hostname, parts.port


def _only(services: Mapping[str, Any], what: str) -> str:
    if len(services) != 1:
        raise CheckError(f"expected one service running {what}, found {sorted(services)}")
    return next(iter(services))


def _published(service: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(published host port, container port) of each `ports` entry, as compose config writes them."""
    return [(str(entry.get("published")), int(entry["target"])) for entry in service.get("ports") or []]


def _secret_target(entry: Mapping[str, Any]) -> str:
    """Where a service's secret is mounted, relative to /run/secrets/ (compose config writes the short syntax's
    target as an absolute path, the long syntax's as given)."""
    return str(entry.get("target") or entry["source"]).removeprefix(SECRETS_MOUNT)


def check_secrets(compose: Compose) -> list[str]:
    """Keys everywhere, nothing --insecure: each pagedkv service reads PAGEDKV_KEYS from its own key directory
    secret; every /run/secrets/ path a service names is a secret it mounts; every secret is a file that
    make-secrets.sh writes under ${SECRETS_DIR}; the gateway wants API keys and blockd its deployment secret and
    Redis' password from them; Redis reads its password from its config file, never from a command line."""
    problems: list[str] = []
    defined = compose.get("secrets") or {}
    made = {p.name for p in secrets_standin().iterdir()}
    for name, secret in defined.items():
        file = Path(secret.get("file") or "")
        if file.parent != COMPOSE_DIR / "secrets" or file.name not in made:
            problems.append(f"secret {name}: {file} is not a file make-secrets.sh writes into ${{SECRETS_DIR}}")
    for name, service in compose["services"].items():
        mounted = {}
        for entry in service.get("secrets") or []:
            if entry["source"] not in defined:
                problems.append(f"{name}: mounts secret {entry['source']!r}, which is not defined")
            mounted[_secret_target(entry)] = entry["source"]
        command = service.get("command") or []
        probe = (service.get("healthcheck") or {}).get("test") or []
        named = {
            m.split("/")[0]
            for text in [*command, *environment(service).values(), *probe]
            for m in re.findall(r"/run/secrets/([\w./-]+)", str(text))
        }
        for target in sorted(named - set(mounted)):
            problems.append(f"{name}: names /run/secrets/{target} but mounts no secret there")
        if "--insecure" in command or environment(service).get("PAGEDKV_INSECURE"):
            problems.append(f"{name}: runs --insecure")
    for name, service in pagedkv_services(compose).items():
        mounted = {_secret_target(e): e["source"] for e in service.get("secrets") or []}
        source = mounted.get("keys", "")
        if source != f"keys-{name}":
            problems.append(f"{name}: mounts {source!r} at /run/secrets/keys, not its own keys-{name}")
        try:
            params = parse_service(name, service)[0].params
        except (click.ClickException, CheckError) as exc:
            problems.append(f"{name}: {_refusal(exc)}")
            continue
        if params.get("keys_dir") != secrets_standin() / "keys":
            problems.append(f"{name}: --keys / PAGEDKV_KEYS is {params.get('keys_dir')}, not /run/secrets/keys")
    gateway = services_running(compose, "pagedkv-gateway")
    for name, service in gateway.items():
        if parse_service(name, service)[0].params["api_key_files"] != (secrets_standin() / "api-keys",):
            problems.append(f"{name}: no --api-key-file /run/secrets/api-keys")
    for name, service in services_running(compose, "blockd").items():
        params = parse_service(name, service)[0].params
        for option, file in (
            ("deployment_secret_file", "deployment-secret"),
            ("redis_password_file", "redis-password"),
        ):
            if params[option] != secrets_standin() / file:
                problems.append(f"{name}: --{option.replace('_', '-')} is not /run/secrets/{file}")
    redis = compose["services"].get("redis") or {}
    if (redis.get("command") or [None, None])[1] != "/run/secrets/redis.conf" or any(
        "requirepass" in str(a) for a in redis.get("command") or []
    ):
        problems.append("redis: must read its password from /run/secrets/redis.conf (requirepass), not argv")
    return problems


def check_endpoints(compose: Compose) -> list[str]:
    """blockd, the executors and the gateway bind where the others connect, with ports that agree."""
    try:
        return _check_endpoints(compose)
    except (click.ClickException, CheckError, KeyError) as exc:
        return [f"cannot check endpoints: {_refusal(exc)}"]


def _check_endpoints(compose: Compose) -> list[str]:
    problems: list[str] = []
    blockd_name = _only(services_running(compose, "blockd"), "blockd")
    gateway_name = _only(services_running(compose, "pagedkv-gateway"), "pagedkv-gateway")
    executors = services_running(compose, "pagedkv-executor")
    if not executors:
        problems.append("no service runs pagedkv-executor")
    blockd = parse_service(blockd_name, compose["services"][blockd_name])[0].params
    bind_host, blockd_port = _endpoint(blockd["endpoint"])
    if bind_host != "0.0.0.0":
        problems.append(f"{blockd_name}: --endpoint {blockd['endpoint']} must bind 0.0.0.0 for the other containers")
    probe = healthcheck_argv(compose["services"][blockd_name])
    if probe and probe[0] == "blockd-cli":
        asked = parse_argv(probe, environment(compose["services"][blockd_name]))[0].params["endpoint"]
        if _endpoint(asked)[1] != blockd_port:
            problems.append(f"{blockd_name}: its healthcheck asks {asked}, blockd listens on port {blockd_port}")
    redis_url = blockd.get("redis_url")
    if redis_url:
        redis = urlsplit(redis_url)
        if redis.hostname not in compose["services"]:
            problems.append(f"{blockd_name}: --redis-url {redis_url} names no service")

    def connects_to_blockd(who: str, value: str) -> None:
        if _endpoint(value) != (blockd_name, blockd_port):
            problems.append(f"{who}: --blockd {value} is not tcp://{blockd_name}:{blockd_port}")

    executor_endpoints: dict[str, int] = {}
    pool_ids: dict[str, str] = {}
    for name, service in executors.items():
        params = parse_service(name, service)[0].params
        connects_to_blockd(name, params["blockd_endpoint"])
        host, port = _endpoint(params["bind"])
        if host != "0.0.0.0":
            problems.append(f"{name}: --bind {params['bind']} must bind 0.0.0.0 for the gateway")
        executor_endpoints[name] = port
        if params["pool_id"] != name:
            problems.append(f"{name}: --pool-id is {params['pool_id']!r}, give it the stable name {name!r}")
        pool_ids[name] = params["pool_id"]
        healthcheck = " ".join(healthcheck_argv(service) or [])
        if str(port) not in re.findall(r"\d+", healthcheck):
            problems.append(f"{name}: its healthcheck {healthcheck!r} does not probe port {port}")

    gateway_service = compose["services"][gateway_name]
    gateway = parse_service(gateway_name, gateway_service)[0].params
    connects_to_blockd(gateway_name, gateway["blockd_endpoint"])
    listed = dict(_endpoint(e) for e in gateway["executors"])
    if set(listed) != set(executor_endpoints):
        problems.append(
            f"{gateway_name}: --executors lists {sorted(listed)}, the executors are {sorted(executor_endpoints)}"
        )
    for name, port in executor_endpoints.items():
        if name in listed and listed[name] != port:
            problems.append(f"{gateway_name}: --executors has {name}:{listed[name]}, {name} binds port {port}")
    if gateway["host"] != "0.0.0.0":
        problems.append(f"{gateway_name}: --host {gateway['host']} is unreachable from outside the container")
    published = [container for _, container in _published(gateway_service)]
    if published != [gateway["port"]]:
        problems.append(f"{gateway_name}: publishes container ports {published}, it listens on {gateway['port']}")
    health = " ".join(healthcheck_argv(gateway_service) or [])
    if f":{gateway['port']}/health" not in health:
        problems.append(f"{gateway_name}: its healthcheck {health!r} does not GET /health on port {gateway['port']}")
    return problems


def check_depends_on(compose: Compose) -> list[str]:
    problems: list[str] = []
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {target: {"condition": "service_started"} for target in depends}
        for target, spec in depends.items():
            condition = (spec or {}).get("condition", "service_started")
            if target not in services:
                problems.append(f"{name}: depends on {target!r}, which is not a service")
            elif condition == "service_healthy" and "healthcheck" not in services[target]:
                problems.append(f"{name}: waits for {target} to be healthy, but {target} has no healthcheck")
            elif condition not in ("service_started", "service_healthy", "service_completed_successfully"):
                problems.append(f"{name}: depends on {target} with unknown condition {condition!r}")
    return problems


def check_gpus(compose: Compose) -> list[str]:
    """Every executor reserves exactly one NVIDIA GPU, a different one each, and runs on it as `cuda`."""
    problems: list[str] = []
    owners: dict[str, str] = {}
    for name, service in services_running(compose, "pagedkv-executor").items():
        devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices") or []
        gpus = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]
        ids = [str(i) for d in gpus for i in d.get("device_ids") or []]
        if len(gpus) != 1 or len(ids) != 1:
            problems.append(f"{name}: reserves {devices!r}; reserve one GPU (driver nvidia, one device_id, [gpu])")
            continue
        if ids[0] in owners:
            problems.append(f"{name}: GPU {ids[0]} is already reserved by {owners[ids[0]]}")
        owners[ids[0]] = name
        device = parse_service(name, service)[0].params["device_spec"]
        if device not in ("cuda", "cuda:0"):  # the one reserved GPU is the only one the container sees
            problems.append(f"{name}: --device {device}; with one reserved GPU use cuda")
    return problems


def check_shared_kv(compose: Compose) -> list[str]:
    """The shared KV tier is on in every executor or in none; where on, its directory (--shared-kv-dir, as the
    executor parses its environment) is a named volume the executor mounts read-write, the same one for all of
    them, and --shared-kv-size goes with it (the executor's own check)."""
    from executor.main import _shared_size

    problems: list[str] = []
    volumes = compose.get("volumes") or {}
    shared: dict[str, str | None] = {}  # executor -> the volume its tier is on (None: off)
    for name, service in services_running(compose, "pagedkv-executor").items():
        try:
            params = parse_service(name, service)[0].params
            _shared_size(params["shared_kv_dir"], params["shared_kv_size"])
        except (click.ClickException, CheckError) as exc:
            problems.append(f"{name}: {_refusal(exc)}")
            continue
        directory = params["shared_kv_dir"]
        shared[name] = None
        if directory is None:
            continue
        mounts = [v for v in service.get("volumes") or [] if Path(v["target"]) == directory]
        if len(mounts) != 1 or mounts[0]["type"] != "volume" or mounts[0].get("source") not in volumes:
            problems.append(f"{name}: --shared-kv-dir {directory} is not a named volume it mounts: {mounts}")
        elif mounts[0].get("read_only"):
            problems.append(f"{name}: its shared KV volume is mounted read-only")
        else:
            shared[name] = mounts[0]["source"]
    sources = set(shared.values())
    if len(sources) > 1:
        problems.append(f"the executors' shared KV tiers are not one volume: {shared}")
    return problems


def _shared_kv_config(files: Sequence[Path], profiles: Sequence[str] = (), size: str = "200GiB") -> Compose:
    """The files as compose runs them with the shared tier on (SHARED_KV_SIZE=size)."""
    env = {**required_variables(files, profiles), "SHARED_KV_SIZE": size}
    return json.loads(docker_compose(files, ["config", "--format", "json"], env, profiles=profiles))


# ----------------------------------------------------------------------------------------------------- tests


@pytest.fixture
def compose() -> Compose:
    return load_compose()


@pytest.fixture
def cpu_compose() -> Compose:
    return load_compose(CPU, CPU_PROFILES)


def _report(problems: list[str]) -> str:
    return "\n".join(problems)


@needs_compose
def test_compose_refuses_to_run_without_a_model() -> None:
    with pytest.raises(ComposeRefused, match="MODEL_DIR"):
        docker_compose(GPU, ["config", "--quiet"])
    assert set(required_variables(GPU)) == {"MODEL_DIR"}
    assert set(required_variables(CPU, CPU_PROFILES)) == {"MODEL_DIR"}


def test_compose_defines_the_stack_and_executors_share_the_anchor() -> None:
    raw = yaml.safe_load(RAW_TEXT)
    assert {"redis", "blockd", "executor-0", "executor-1", "gateway"} <= set(raw["services"])
    assert "x-executor" in raw, "the executor definition is the x-executor anchor"
    # The merge key must point at the very x-executor node, so a change there reaches every executor.
    root = yaml.compose(RAW_TEXT)
    top = {key.value: value for key, value in root.value}
    services = {key.value: value for key, value in top["services"].value}
    for name in ("executor-0", "executor-1"):
        merged = [v for k, v in services[name].value if k.tag == "tag:yaml.org,2002:merge"]
        assert merged and merged[0] is top["x-executor"], f"{name} is not defined by `<<: *executor`"


def _build_args(service: Mapping[str, Any]) -> dict[str, str]:
    return service["build"].get("args") or {}


def test_pagedkv_services_build_one_image_and_restart(compose: Compose, cpu_compose: Compose) -> None:
    for config, image, torch in ((compose, IMAGE, "cuda"), (cpu_compose, CPU_IMAGE, "cpu")):
        services = pagedkv_services(config, image)
        expected = {"blockd", "executor-0", "executor-1", "gateway"} | (
            {"executor-2"} if config is cpu_compose else set()
        )
        assert set(services) == expected, sorted(config["services"])
        for name, service in services.items():
            assert Path(service["build"]["context"]) == ROOT and service["build"]["dockerfile"] == "compose/Dockerfile"
            args = _build_args(service)
            assert args.get("TORCH") == torch, f"{name}: the {image} image is built with TORCH={args.get('TORCH')}"
            assert args.get("BASE_IMAGE") == "python:3.12-slim", f"{name}: the default base is the Hub's python"
            assert {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS"} <= set(args), name
        for name, service in config["services"].items():
            assert service.get("restart") == "unless-stopped", f"{name}: restart must be unless-stopped"


@needs_compose
def test_build_arguments_and_redis_image_come_from_variables() -> None:
    env = {
        **required_variables(CPU, CPU_PROFILES),
        "BASE_IMAGE": "local/python:3.11",
        "REDIS_IMAGE": "local/redis:7",
        "BUILD_PIP_FIND_LINKS": "http://localhost:8999/",
        "BUILD_PIP_EXTRA_INDEX_URL": "http://127.0.0.1:9/simple",
        "BUILD_NETWORK": "host",
    }
    config = json.loads(docker_compose(CPU, ["config", "--format", "json"], env, profiles=CPU_PROFILES))
    assert config["services"]["redis"]["image"] == "local/redis:7"
    for name, service in pagedkv_services(config, CPU_IMAGE).items():
        args = _build_args(service)
        assert args["BASE_IMAGE"] == "local/python:3.11" and args["TORCH"] == "cpu", name
        assert args["PIP_FIND_LINKS"] == "http://localhost:8999/", name
        assert args["PIP_EXTRA_INDEX_URL"] == "http://127.0.0.1:9/simple" and args["PIP_INDEX_URL"] == "", name
        assert service["build"]["network"] == "host", name
    dockerfile_args = {args.split("=")[0] for kind, args in _dockerfile_instructions() if kind == "ARG"}
    assert set(_build_args(config["services"]["blockd"])) <= dockerfile_args, "a build arg the Dockerfile ignores"


@needs_compose
def test_every_variable_is_in_env_example_with_the_compose_default() -> None:
    variables = {**config_variables(GPU), **config_variables(CPU, CPU_PROFILES)}
    names = set(variables)
    assert names <= set(EXAMPLE), (
        f"read by the compose files, missing from .env.example: {sorted(names - set(EXAMPLE))}"
    )
    assert set(EXAMPLE) <= names, f"in .env.example, read by nothing: {sorted(set(EXAMPLE) - names)}"
    for name, default in variables.items():
        if default is not None:
            assert EXAMPLE[name] == default, (
                f".env.example says {name}={EXAMPLE[name]}, the compose files default it to {default!r}"
            )
    undocumented = sorted(set(EXAMPLE) - set(EXAMPLE_COMMENTS))
    assert not undocumented, f"give each a comment line in .env.example: {undocumented}"
    # With the whole example file as the environment, compose runs the very same services.
    assert load_compose(example=True) == load_compose()
    assert load_compose(CPU, CPU_PROFILES, example=True) == load_compose(CPU, CPU_PROFILES)


def test_commands_and_environments_are_accepted_by_the_real_clis(compose: Compose, cpu_compose: Compose) -> None:
    for script in SERVICE_SCRIPTS:
        assert script in console_scripts(), f"pyproject.toml [project.scripts] has no {script!r}"
    assert check_commands(compose) == [], _report(check_commands(compose))
    assert check_commands(cpu_compose) == [], _report(check_commands(cpu_compose))


def test_every_service_runs_with_keys_from_secrets(compose: Compose, cpu_compose: Compose) -> None:
    assert check_secrets(compose) == [], _report(check_secrets(compose))
    assert check_secrets(cpu_compose) == [], _report(check_secrets(cpu_compose))
    assert set(cpu_compose["secrets"]) >= {"keys-blockd", "keys-gateway", "api-keys", "redis-password"}


def test_secrets_check_catches_insecure_and_unmounted_secrets(compose: Compose) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["executor-0"]["command"].append("--insecure")
    broken["services"]["gateway"]["secrets"] = []
    broken["services"]["blockd"]["environment"].pop("PAGEDKV_KEYS")
    problems = _report(check_secrets(broken))
    assert "executor-0: runs --insecure" in problems
    assert "gateway: names /run/secrets/api-keys but mounts no secret there" in problems
    assert "blockd: --keys / PAGEDKV_KEYS is None" in problems


def test_make_secrets_writes_each_service_only_its_own_secret_keys() -> None:
    standin = secrets_standin()
    secret_keys = {d.name: sorted(p.name for p in d.glob("*.key_secret")) for d in standin.glob("keys-*")}
    assert secret_keys == {
        "keys-blockd": ["operator.key_secret", "server.key_secret"],
        "keys-gateway": ["gateway.key_secret"],
        **{f"keys-executor-{n}": [f"pool-executor-{n}.key_secret", "server.key_secret"] for n in range(3)},
    }
    password = (standin / "redis-password").read_text().strip()
    assert (standin / "redis.conf").read_text() == f"requirepass {password}\n"
    assert (standin / "api-keys").read_text().startswith("sk-")


def test_endpoints_agree(compose: Compose, cpu_compose: Compose) -> None:
    assert check_endpoints(compose) == [], _report(check_endpoints(compose))
    assert check_endpoints(cpu_compose) == [], _report(check_endpoints(cpu_compose))
    for config in (compose, cpu_compose):
        assert _published(config["services"]["gateway"]) == [(EXAMPLE["GATEWAY_PORT"], 8000)], "publish GATEWAY_PORT"


def test_depends_on_names_defined_services(compose: Compose, cpu_compose: Compose) -> None:
    for config in (compose, cpu_compose):
        assert check_depends_on(config) == [], _report(check_depends_on(config))
        assert config["services"]["gateway"]["depends_on"]["blockd"]["condition"] == "service_healthy"


def test_every_executor_reserves_its_own_gpu(compose: Compose) -> None:
    assert check_gpus(compose) == [], _report(check_gpus(compose))


def test_cpu_executors_reserve_no_gpu_and_run_on_the_cpu(cpu_compose: Compose) -> None:
    executors = services_running(cpu_compose, "pagedkv-executor")
    assert set(executors) == {"executor-0", "executor-1", "executor-2"}
    for name, service in executors.items():
        assert "deploy" not in service, f"{name}: reserves {service['deploy']} on a host without GPUs"
        params = parse_service(name, service)[0].params
        assert params["device_spec"] == "cpu", name
        assert params["kv_cache_memory"] == "512MiB", f"{name}: a KV cache in bytes on the CPU"
        assert cpu_compose["services"][name]["environment"]["OMP_NUM_THREADS"], name
    assert cpu_compose["services"]["executor-2"].get("profiles") == ["executor-2"], "executor-2 starts on demand"
    # Without its profile, executor-2 is not part of the stack, and nothing waits for it.
    plain = load_compose(CPU)
    assert "executor-2" not in plain["services"]
    assert "executor-2" not in plain["services"]["gateway"].get("depends_on", {})


def test_model_is_mounted_read_only_where_the_clis_look(compose: Compose, cpu_compose: Compose) -> None:
    for config in (compose, cpu_compose):
        for name in (*services_running(config, "pagedkv-executor"), *services_running(config, "pagedkv-gateway")):
            service = config["services"][name]
            assert parse_service(name, service)[0].params["model_dir"] == Path(MODEL_MOUNT), name
            mounts = [(v["type"], v["source"], v["target"], v.get("read_only")) for v in service.get("volumes", [])]
            assert ("bind", EXAMPLE["MODEL_DIR"], MODEL_MOUNT, True) in mounts, (
                f"{name}: MODEL_DIR must be mounted read-only at {MODEL_MOUNT}: {mounts}"
            )


def test_shared_kv_tier_is_off_by_default_with_its_volume_mounted(compose: Compose, cpu_compose: Compose) -> None:
    for config in (compose, cpu_compose):
        assert check_shared_kv(config) == [], _report(check_shared_kv(config))
        assert SHARED_KV_VOLUME in config["volumes"]
        for name, service in services_running(config, "pagedkv-executor").items():
            params = parse_service(name, service)[0].params
            assert params["shared_kv_dir"] is None and params["shared_kv_size"] == "0", f"{name}: the tier is on"
            mounts = [(v["type"], v.get("source"), v["target"]) for v in service["volumes"]]
            assert ("volume", SHARED_KV_VOLUME, SHARED_KV_MOUNT) in mounts, f"{name}: {mounts}"


@needs_compose
@pytest.mark.parametrize(("files", "profiles"), [(GPU, ()), (CPU, CPU_PROFILES)], ids=["gpu", "cpu"])
def test_shared_kv_size_turns_the_tier_on_in_every_executor_on_one_volume(
    files: tuple[Path, ...], profiles: tuple[str, ...]
) -> None:
    """SHARED_KV_SIZE alone turns it on: every executor's --shared-kv-dir is the mount of the one shared-kv
    volume, with the size given; the CLIs take the result as they take the default."""
    from executor.main import _shared_size

    config = _shared_kv_config(files, profiles)
    assert check_shared_kv(config) == [], _report(check_shared_kv(config))
    assert check_commands(config) == [], _report(check_commands(config))
    executors = services_running(config, "pagedkv-executor")
    assert len(executors) == (3 if profiles else 2)
    for name, service in executors.items():
        params = parse_service(name, service)[0].params
        assert params["shared_kv_dir"] == Path(SHARED_KV_MOUNT), name
        assert _shared_size(params["shared_kv_dir"], params["shared_kv_size"]) == 200 << 30, name
        [mount] = [v for v in service["volumes"] if v["target"] == SHARED_KV_MOUNT]
        assert mount["type"] == "volume" and mount["source"] == SHARED_KV_VOLUME and not mount.get("read_only")
    # Only the executors read or write it.
    for name, service in pagedkv_services(config).items():
        if name not in executors:
            assert all(v["target"] != SHARED_KV_MOUNT for v in service.get("volumes") or []), name
    # The one setting changes nothing else.
    assert _without_shared_kv(config) == _without_shared_kv(load_compose(files, profiles))


def _without_shared_kv(config: Compose) -> Compose:
    """The config less the two shared-tier variables of the executors (and the x- extensions they come from)."""
    config = {key: value for key, value in copy.deepcopy(config).items() if not key.startswith("x-")}
    for service in services_running(config, "pagedkv-executor").values():
        for var in ("PAGEDKV_EXECUTOR_SHARED_KV_DIR", "PAGEDKV_EXECUTOR_SHARED_KV_SIZE"):
            service["environment"].pop(var)
    return config


@needs_compose
def test_shared_kv_check_catches_executors_apart() -> None:
    config = _shared_kv_config(GPU)
    assert check_shared_kv(config) == []
    other = copy.deepcopy(config)
    other["volumes"]["other-kv"] = {"name": "pagedkv_other-kv"}
    [mount] = [v for v in other["services"]["executor-1"]["volumes"] if v["target"] == SHARED_KV_MOUNT]
    mount["source"] = "other-kv"
    assert "the executors' shared KV tiers are not one volume" in _report(check_shared_kv(other))
    unmounted = copy.deepcopy(config)
    unmounted["services"]["executor-0"]["environment"]["PAGEDKV_EXECUTOR_SHARED_KV_DIR"] = "/tmp/kv"
    assert "executor-0: --shared-kv-dir /tmp/kv is not a named volume it mounts" in _report(check_shared_kv(unmounted))
    sizeless = copy.deepcopy(config)
    sizeless["services"]["executor-1"]["environment"]["PAGEDKV_EXECUTOR_SHARED_KV_SIZE"] = ""
    assert "--shared-kv-dir and --shared-kv-size go together" in _report(check_shared_kv(sizeless))
    read_only = copy.deepcopy(config)
    [mount] = [v for v in read_only["services"]["executor-0"]["volumes"] if v["target"] == SHARED_KV_MOUNT]
    mount["read_only"] = True
    assert "executor-0: its shared KV volume is mounted read-only" in _report(check_shared_kv(read_only))


def test_redis_persists_to_a_named_volume(compose: Compose) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"] == EXAMPLE["REDIS_IMAGE"] and redis["image"].startswith("redis:"), "the Hub's redis"
    command = redis["command"]
    assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"
    (volume,) = redis["volumes"]
    assert volume["type"] == "volume" and volume["target"] == "/data", "redis' /data must be a named volume"
    assert volume["source"] in (compose.get("volumes") or {})
    # The healthcheck authenticates (REDISCLI_AUTH, not -a on a command line) and wants PONG, not an error.
    probe = redis["healthcheck"]["test"]
    assert probe[0] == "CMD-SHELL" and "REDISCLI_AUTH" in probe[1] and "/run/secrets/redis-password" in probe[1]
    assert "grep -q PONG" in probe[1]
    blockd = parse_service("blockd", compose["services"]["blockd"])[0].params
    assert urlsplit(blockd["redis_url"]).hostname == "redis"


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def _packages() -> list[str]:
    """The top-level packages pyproject.toml installs."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(p.rstrip("*") for p in include)


def test_dockerfile_installs_every_package_from_a_variable_base(compose: Compose) -> None:
    instructions = _dockerfile_instructions()
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.12-slim") and instructions[1] == ("FROM", "${BASE_IMAGE}")
    copied = {args.split()[0] for kind, args in instructions if kind == "COPY"}
    missing = [p for p in _packages() if p not in copied]
    assert not missing, f"the image would lack {missing}: COPY every package pyproject.toml installs"
    runs = " ".join(args for kind, args in instructions if kind == "RUN")
    assert 'pip install "torch==2.13.0+cpu"' in runs, "the CPU variant installs the CPU torch first"
    assert "pip install . " in runs, "the project is installed with `pip install .`"


def test_dockerfile_makes_the_shared_kv_mount_point_the_executors_own() -> None:
    """A new named volume takes the owner of the directory it is mounted on: the image's, made before USER and
    given to that user, so the executors can write to a fresh shared-kv volume."""
    instructions = _dockerfile_instructions()
    users = [i for i, (kind, _) in enumerate(instructions) if kind == "USER"]
    user = instructions[users[-1]][1]
    made = [
        i
        for i, (kind, args) in enumerate(instructions)
        if kind == "RUN"
        and f"mkdir -p {SHARED_KV_MOUNT}" in args
        and re.search(rf"chown -R {user}:{user} /var/lib", args)
    ]
    assert made and made[0] < users[-1], f"RUN mkdir -p {SHARED_KV_MOUNT} && chown -R {user}:{user} before USER"
    assert any(kind == "RUN" and "useradd" in args and user in args for kind, args in instructions[: made[0]])


def test_dockerignore_keeps_the_context_to_the_packages() -> None:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and line[0] != "#"]
    assert lines[0] == "*", "exclude everything, then let in what the image is built from"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", *_packages()}, allowed


def test_dockerfile_exposes_every_port_and_runs_unprivileged(compose: Compose) -> None:
    instructions = _dockerfile_instructions()
    exposed = {int(p.split("/")[0]) for kind, args in instructions if kind == "EXPOSE" for p in args.split()}
    used = {
        _endpoint(parse_service(n, s)[0].params["bind"])[1]
        for n, s in services_running(compose, "pagedkv-executor").items()
    }
    blockd = parse_service("blockd", compose["services"]["blockd"])[0].params
    gateway = parse_service("gateway", compose["services"]["gateway"])[0].params
    used |= {_endpoint(blockd["endpoint"])[1], gateway["port"], blockd["metrics_port"]} - {0}
    assert used <= exposed, f"EXPOSE {sorted(exposed)} misses {sorted(used - exposed)}"
    users = [args for kind, args in instructions if kind == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"


def test_dockerfile_copies_every_package_pip_installs() -> None:
    """`pip install .` builds what pyproject's package list names from what COPY put in the image: a package
    left out installs nothing, and the services fail at their first import of it."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    wanted = {pattern.rstrip("*") for pattern in packages["include"]}
    copied = {args.split()[0] for kind, args in _dockerfile_instructions() if kind == "COPY"}
    assert wanted and all((ROOT / name).is_dir() for name in wanted), wanted
    assert wanted <= copied, f"the Dockerfile does not COPY {sorted(wanted - copied)}"


def test_no_url_leaves_the_deployment() -> None:
    """Every URL in compose/ points into the stack itself: no package index or other outside host."""
    services = yaml.safe_load(RAW_TEXT)["services"]
    local = {"127.0.0.1", "0.0.0.0", "localhost", *services}
    observability = sorted(p for p in (COMPOSE_DIR / "observability").rglob("*") if p.is_file())
    for path in (DOCKERFILE, ENV_EXAMPLE, COMPOSE_FILE, CPU_FILE, README, DOCKERIGNORE, *observability):
        for url in re.findall(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"`)]+", path.read_text()):
            host = urlsplit(url).hostname or ""
            ok = host in local or re.fullmatch(r"executor-\d+", host)  # the README's next executor
            assert ok, f"{path.name} names an outside URL: {url}"


def test_readme_covers_every_variable_and_the_operator_commands() -> None:
    text = README.read_text()
    missing = [name for name in EXAMPLE if name not in text]
    assert not missing, f"README.md does not explain {missing}"
    for needed in (
        "--env-file",
        "/v1/models",
        "/v1/chat/completions",
        "blockd-cli stats",
        "device_ids",
        "docker-compose.cpu.yml",
        "--profile executor-2",
        "make compose-test",
    ):
        assert needed in text, f"README.md does not show {needed}"


# --------------------------------------------------------------------------------------- the checkers work


def _gateway_flag(compose: Compose) -> None:
    compose["services"]["gateway"]["command"].append("--no-such-flag")


def _gateway_unknown_env(compose: Compose) -> None:
    compose["services"]["gateway"]["environment"]["PAGEDKV_GATEWAY_NO_SUCH_OPTION"] = "1"


def _bad_routing(compose: Compose) -> None:
    compose["services"]["gateway"]["environment"]["PAGEDKV_GATEWAY_ROUTING"] = "fastest"


def _flag_overrides_env(compose: Compose) -> None:
    compose["services"]["gateway"]["command"] += ["--routing", "round-robin"]


def _not_a_script(compose: Compose) -> None:
    compose["services"]["blockd"]["command"][0] = "blockdd"


def _executor_bind_port(compose: Compose) -> None:
    command = compose["services"]["executor-1"]["command"]
    command[command.index("--bind") + 1] = "tcp://0.0.0.0:5561"


def _executor_localhost(compose: Compose) -> None:
    command = compose["services"]["executor-0"]["command"]
    command[command.index("--bind") + 1] = "tcp://127.0.0.1:5560"


def _blockd_port(compose: Compose) -> None:
    command = compose["services"]["blockd"]["command"]
    command[command.index("--endpoint") + 1] = "tcp://0.0.0.0:5558"


def _dangling_dependency(compose: Compose) -> None:
    compose["services"]["gateway"]["depends_on"]["executor-7"] = {"condition": "service_started"}


def _empty_unknown_env(compose: Compose) -> None:
    compose["services"]["executor-0"]["environment"]["PAGEDKV_EXECUTOR_SHARED_KV_DIRECTORY"] = ""


def _empty_env_and_flag(compose: Compose) -> None:
    compose["services"]["executor-0"]["command"] += ["--shared-kv-dir", "/tmp/kv", "--shared-kv-size", "1GiB"]


def _shared_gpu(compose: Compose) -> None:
    devices = compose["services"]["executor-1"]["deploy"]["resources"]["reservations"]["devices"]
    devices[0]["device_ids"] = ["0"]


@pytest.mark.parametrize(
    ("checker", "mutate", "expected"),
    [
        (check_commands, _gateway_flag, "gateway: ['pagedkv-gateway'"),
        (check_commands, _gateway_unknown_env, "PAGEDKV_GATEWAY_NO_SUCH_OPTION is not read by any option"),
        (check_commands, _bad_routing, "PAGEDKV_GATEWAY_ROUTING='fastest' is refused"),
        (check_commands, _flag_overrides_env, "PAGEDKV_GATEWAY_ROUTING is overridden by a flag"),
        (check_commands, _not_a_script, "'blockdd' is not a console script"),
        (check_endpoints, _executor_bind_port, "gateway: --executors has executor-1:5560, executor-1 binds port 5561"),
        (check_endpoints, _executor_localhost, "executor-0: --bind tcp://127.0.0.1:5560 must bind 0.0.0.0"),
        (check_endpoints, _blockd_port, "--blockd tcp://blockd:5557 is not tcp://blockd:5558"),
        (check_depends_on, _dangling_dependency, "depends on 'executor-7', which is not a service"),
        (check_gpus, _shared_gpu, "executor-1: GPU 0 is already reserved by executor-0"),
        (check_commands, _empty_unknown_env, "PAGEDKV_EXECUTOR_SHARED_KV_DIRECTORY is not read by any option"),
        (check_commands, _empty_env_and_flag, "PAGEDKV_EXECUTOR_SHARED_KV_DIR is overridden by a flag"),
        (check_shared_kv, _empty_env_and_flag, "executor-0: --shared-kv-dir /tmp/kv is not a named volume"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_checker_catches_a_broken_file(
    compose: Compose, checker: Callable[[Compose], list[str]], mutate: Callable[[Compose], None], expected: str
) -> None:
    assert checker(compose) == [], "the real file must pass before a broken copy means anything"
    broken = copy.deepcopy(compose)
    mutate(broken)
    problems = checker(broken)
    assert any(expected in p for p in problems), f"expected a problem containing {expected!r}, got {problems}"


def test_checker_names_the_wrong_flag(compose: Compose) -> None:
    broken = copy.deepcopy(compose)
    _gateway_flag(broken)
    (problem,) = check_commands(broken)
    assert "--no-such-flag" in problem and problem.startswith("gateway:"), problem
