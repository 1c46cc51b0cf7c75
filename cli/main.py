"""``sp-bench``: inspect and measure sequence-parallel attention backends."""

from __future__ import annotations

import sys

import click

from ulysses_sp import registry


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Inspect and measure ulysses-sp's sequence-parallel attention backends."""


@main.command("backends")
def backends() -> None:
    """List the registered backends and what each one needs."""
    for name in registry.list_backends():
        backend = registry.get_backend(name)
        doc = (sys.modules[type(backend).__module__].__doc__ or "").strip().splitlines()
        click.echo(f"{name:10s} {doc[0] if doc else ''}")


if __name__ == "__main__":
    main()
