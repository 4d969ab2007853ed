"""click helpers shared by the command lines."""

from __future__ import annotations

import click


def unless_given(ctx: click.Context, value: object, name: str, fallback: object) -> object:
    """`fallback` if the option `name` was left at its default (a bench's --quick), else what was given."""
    return fallback if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT else value
