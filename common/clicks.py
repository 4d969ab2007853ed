"""click helpers shared by the command lines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def unless_given(ctx: click.Context, value: object, name: str, fallback: object) -> object:
    """`fallback` if the option `name` was left at its default (a bench's --quick), else what was given."""
    return fallback if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT else value


def keys_option(help: str) -> Callable[[F], F]:
    """`--keys DIR` (env PAGEDKV_KEYS): the key directory `pagedkv keys generate` wrote; `help` says what it does
    for this command."""
    from common.auth import KEYS_ENV

    return click.option(
        "--keys",
        "keys_dir",
        envvar=KEYS_ENV,
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help=f"{help} Env: {KEYS_ENV}.",
    )


def insecure_option(help: str) -> Callable[[F], F]:
    """`--insecure` (env PAGEDKV_INSECURE): listen beyond loopback without keys; `help` says what that opens."""
    return click.option("--insecure", is_flag=True, default=False, envvar="PAGEDKV_INSECURE", help=help)


def client_keys(keys_dir: Path | None, key_name: str) -> Any:
    """The CURVE client keys `key_name` of `keys_dir` (None without a directory); a usage error when unreadable."""
    if keys_dir is None:
        return None
    from common.auth import KeysError, KeySet

    try:
        return KeySet(keys_dir).client(key_name)
    except KeysError as exc:
        raise click.ClickException(str(exc)) from None
