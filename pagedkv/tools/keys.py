"""`pagedkv keys`: make the key files of an authenticated deployment (see common.auth for what each key may do)."""

from __future__ import annotations

from pathlib import Path

import click

from common.auth import KeysError, generate


@click.group()
def keys() -> None:
    """CURVE key files for blockd, executors, gateways and operators."""


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--pool",
    "pools",
    multiple=True,
    help="Make an executor key that may act only on this pool (pool-POOL); repeat for each executor. "
    "Without it: one `executor` key for any pool.",
)
@click.option("--force", is_flag=True, help="Overwrite keys already in DIRECTORY.")
def generate_keys(directory: Path, pools: tuple[str, ...], force: bool) -> None:
    """Write a key set into DIRECTORY: server (blockd and the executors), gateway, operator, executor(s).

    Give every service the directory with --keys DIR or PAGEDKV_KEYS=DIR. Each reads only what it needs: its own
    secret key and the public keys it must trust. To keep a secret from a service, give it a copy of the
    directory without the other roles' *.key_secret files."""
    try:
        written = generate(directory, pools, force=force)
    except KeysError as exc:
        raise click.ClickException(str(exc)) from None
    for path in written:
        click.echo(str(path))
