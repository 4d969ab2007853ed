"""compose/: the Docker Compose deployment, checked without a Docker engine.

The compose file is loaded, its `${VAR:-default}` interpolations are resolved the way compose resolves them, and
every pagedkv command in it (service commands and healthchecks) is parsed by the real click command behind its
console script in pyproject.toml, under the service's own environment. So a renamed flag, an environment variable
no option reads, endpoints that disagree or a variable missing from .env.example fail here, not at `compose up`.

Each check is a function returning a list of problems, so the negative tests can show it catches a broken file.
"""

from __future__ import annotations

import copy
import functools
import importlib
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"
DOCKERFILE = COMPOSE_DIR / "Dockerfile"
README = COMPOSE_DIR / "README.md"

IMAGE = "pagedkv:latest"
SERVICE_SCRIPTS = ("blockd", "pagedkv-executor", "pagedkv-gateway")
# Variables with these prefixes are meant for a pagedkv CLI: each must reach an option of the service's command.
CLI_ENV_PREFIXES = ("PAGEDKV_EXECUTOR_", "PAGEDKV_GATEWAY_", "BLOCKD_")
MODEL_MOUNT = "/models/model"

Compose = dict[str, Any]


# ---------------------------------------------------------------------------------------------- interpolation


class InterpolationError(ValueError):
    pass


# $$ (a literal $), ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}, $NAME; anything
# else after a $ is an error, as in compose.
_REFERENCE = re.compile(
    r"\$(?:(?P<escaped>\$)"
    r"|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<invalid>))"
)


@dataclass(frozen=True)
class Reference:
    name: str
    default: str | None  # None: the variable has no default and must be set


def _references(text: str) -> Iterator[tuple[re.Match[str], Reference | None]]:
    for match in _REFERENCE.finditer(text):
        if match["escaped"]:
            yield match, None
            continue
        if match["invalid"] is not None:
            raise InterpolationError(f"a $ that starts no variable in {text!r} (write $$ for a literal $)")
        arg = match["arg"]
        if arg is not None and "$" in arg:
            raise InterpolationError(f"nested interpolation in {text!r} is not supported by this check")
        default = arg if match["op"] in (":-", "-") else None
        yield match, Reference(match["name"] or match["bare"], default)


def references(text: str) -> list[Reference]:
    return [ref for _, ref in _references(text) if ref is not None]


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """`text` with every variable replaced from `env` or its default; a variable without either is an error."""
    out: list[str] = []
    last = 0
    for match, ref in _references(text):
        out.append(text[last : match.start()])
        last = match.end()
        if ref is None:
            out.append("$")
            continue
        value, op = env.get(ref.name), match["op"]
        if op == ":-":
            out.append(value if value else match["arg"])
        elif op == "-":
            out.append(match["arg"] if value is None else value)
        elif value is None or (op == ":?" and not value):
            raise InterpolationError(f"${{{ref.name}}} is not set and has no default ({match['arg'] or text!r})")
        else:
            out.append(value)
    out.append(text[last:])
    return "".join(out)


def strings(node: Any) -> Iterator[str]:
    """Every string value in a loaded YAML document (compose interpolates values, not keys)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, list):
        for item in node:
            yield from strings(item)
    elif isinstance(node, dict):
        for item in node.values():
            yield from strings(item)


def resolve(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [resolve(item, env) for item in node]
    if isinstance(node, dict):
        return {key: resolve(value, env) for key, value in node.items()}
    return node


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
RAW: Compose = yaml.safe_load(RAW_TEXT)
EXAMPLE, EXAMPLE_COMMENTS = read_env_file(ENV_EXAMPLE)
REFERENCES = [ref for text in strings(RAW) for ref in references(text)]


def defaults_env(refs: list[Reference], example: Mapping[str, str]) -> dict[str, str]:
    """What a fresh user sets: only the variables without a default, with .env.example's values."""
    env: dict[str, str] = {}
    for ref in refs:
        if ref.default is None:
            if ref.name not in example:
                raise InterpolationError(f"${{{ref.name}}} has no default and is not in .env.example")
            env[ref.name] = example[ref.name]
    return env


def load_compose() -> Compose:
    """The compose file as compose would run it with nothing but the required variables set."""
    return resolve(copy.deepcopy(RAW), defaults_env(REFERENCES, EXAMPLE))


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


def parse_argv(argv: list[str], env: Mapping[str, str]) -> list[click.Context]:
    """Parse `argv` (console script first) with the real click command under exactly `env`, as the process in
    the container would; returns the command's context, then each subcommand's. Raises click's own errors."""
    script, args = argv[0], list(argv[1:])
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


def pagedkv_services(compose: Compose) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if s.get("image") == IMAGE}


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
    """(host side, container port) of each `ports` entry in the short syntax."""
    out = []
    for entry in service.get("ports") or []:
        host, _, container = str(entry).rpartition(":")
        out.append((host, int(container.split("/")[0])))
    return out


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


# ----------------------------------------------------------------------------------------------------- tests


@pytest.fixture
def compose() -> Compose:
    return load_compose()


def _report(problems: list[str]) -> str:
    return "\n".join(problems)


def test_interpolation_follows_compose_rules() -> None:
    env = {"SET": "x", "EMPTY": ""}
    assert interpolate("${SET:-d}/${UNSET:-d}/${EMPTY:-d}/${EMPTY-d}/${UNSET-d}", env) == "x/d/d//d"
    assert interpolate("$SET ${SET} ${SET:?needed} $$SET", env) == "x x x $SET"
    for text in ("${UNSET}", "$UNSET", "${UNSET:?needed}", "${EMPTY:?needed}"):
        with pytest.raises(InterpolationError):
            interpolate(text, env)
    with pytest.raises(InterpolationError, match=r"not in \.env\.example"):
        defaults_env(references("${MODEL_DIR:?required} ${NOT_LISTED}"), {"MODEL_DIR": "/m"})


def test_compose_defines_the_stack_and_executors_share_the_anchor() -> None:
    assert {"redis", "blockd", "executor-0", "executor-1", "gateway"} <= set(RAW["services"])
    assert "x-executor" in RAW, "the executor definition is the x-executor anchor"
    # The merge key must point at the very x-executor node, so a change there reaches every executor.
    root = yaml.compose(RAW_TEXT)
    top = {key.value: value for key, value in root.value}
    services = {key.value: value for key, value in top["services"].value}
    for name in ("executor-0", "executor-1"):
        merged = [v for k, v in services[name].value if k.tag == "tag:yaml.org,2002:merge"]
        assert merged and merged[0] is top["x-executor"], f"{name} is not defined by `<<: *executor`"


def test_pagedkv_services_build_one_image_and_restart(compose: Compose) -> None:
    assert set(pagedkv_services(compose)) == {"blockd", "executor-0", "executor-1", "gateway"}
    for name, service in pagedkv_services(compose).items():
        assert service["build"] == {"context": "..", "dockerfile": "compose/Dockerfile"}, name
    for name, service in compose["services"].items():
        assert service.get("restart") == "unless-stopped", f"{name}: restart must be unless-stopped"


def test_every_variable_is_in_env_example_with_the_compose_default() -> None:
    names = {ref.name for ref in REFERENCES}
    assert names <= set(EXAMPLE), f"read by the compose file, missing from .env.example: {sorted(names - set(EXAMPLE))}"
    assert set(EXAMPLE) <= names, f"in .env.example, read by nothing: {sorted(set(EXAMPLE) - names)}"
    for ref in REFERENCES:
        if ref.default is not None:
            assert EXAMPLE[ref.name] == ref.default, (
                f".env.example says {ref.name}={EXAMPLE[ref.name]}, the compose file defaults it to {ref.default!r}"
            )
    undocumented = sorted(set(EXAMPLE) - set(EXAMPLE_COMMENTS))
    assert not undocumented, f"give each a comment line in .env.example: {undocumented}"
    # With the whole example file as the environment, compose runs the very same services.
    assert resolve(copy.deepcopy(RAW), EXAMPLE) == load_compose()


def test_commands_and_environments_are_accepted_by_the_real_clis(compose: Compose) -> None:
    for script in SERVICE_SCRIPTS:
        assert script in console_scripts(), f"pyproject.toml [project.scripts] has no {script!r}"
    assert check_commands(compose) == [], _report(check_commands(compose))


def test_endpoints_agree(compose: Compose) -> None:
    assert check_endpoints(compose) == [], _report(check_endpoints(compose))
    assert _published(compose["services"]["gateway"]) == [(EXAMPLE["GATEWAY_PORT"], 8000)], "publish GATEWAY_PORT"


def test_depends_on_names_defined_services(compose: Compose) -> None:
    assert check_depends_on(compose) == [], _report(check_depends_on(compose))
    assert compose["services"]["gateway"]["depends_on"]["blockd"]["condition"] == "service_healthy"


def test_every_executor_reserves_its_own_gpu(compose: Compose) -> None:
    assert check_gpus(compose) == [], _report(check_gpus(compose))


def test_model_is_mounted_read_only_where_the_clis_look(compose: Compose) -> None:
    for name in (*services_running(compose, "pagedkv-executor"), *services_running(compose, "pagedkv-gateway")):
        service = compose["services"][name]
        assert parse_service(name, service)[0].params["model_dir"] == Path(MODEL_MOUNT), name
        assert f"{EXAMPLE['MODEL_DIR']}:{MODEL_MOUNT}:ro" in service.get("volumes", []), (
            f"{name}: MODEL_DIR must be mounted read-only at {MODEL_MOUNT}"
        )


def test_redis_persists_to_a_named_volume(compose: Compose) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:")
    command = redis["command"]
    assert "--appendonly" in command and command[command.index("--appendonly") + 1] == "yes"
    volume, _, target = redis["volumes"][0].partition(":")
    assert target == "/data" and volume in (compose.get("volumes") or {}), "redis' /data must be a named volume"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    blockd = parse_service("blockd", compose["services"]["blockd"])[0].params
    assert urlsplit(blockd["redis_url"]).hostname == "redis"


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


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
    assert any(
        kind == "RUN" and "pip install" in args and args.split("&&")[0].strip().endswith(" .")
        for kind, args in instructions
    ), "the project is installed with `pip install .`"


def test_dockerfile_copies_every_package_pip_installs() -> None:
    """`pip install .` builds what pyproject's package list names from what COPY put in the image: a package
    left out installs nothing, and the services fail at their first import of it."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    wanted = {pattern.rstrip("*") for pattern in packages["include"]}
    copied = {args.split()[0] for kind, args in _dockerfile_instructions() if kind == "COPY"}
    assert wanted and all((ROOT / name).is_dir() for name in wanted), wanted
    assert wanted <= copied, f"the Dockerfile does not COPY {sorted(wanted - copied)}"


def test_no_url_leaves_the_deployment(compose: Compose) -> None:
    """Every URL in compose/ points into the stack itself: no package index or other outside host."""
    local = {"127.0.0.1", "0.0.0.0", "localhost", *compose["services"]}
    for path in (DOCKERFILE, ENV_EXAMPLE, COMPOSE_FILE, README):
        for url in re.findall(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"`)]+", path.read_text()):
            host = urlsplit(url).hostname or ""
            ok = host in local or re.fullmatch(r"executor-\d+", host)  # the README's next executor
            assert ok, f"{path.name} names an outside URL: {url}"


def test_readme_covers_every_variable_and_the_operator_commands() -> None:
    text = README.read_text()
    missing = [name for name in EXAMPLE if name not in text]
    assert not missing, f"README.md does not explain {missing}"
    for needed in ("--env-file", "/v1/models", "/v1/chat/completions", "blockd-cli stats", "device_ids"):
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
