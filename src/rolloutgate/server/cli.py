"""`rolloutgate serve`: flags, each also settable as `ROLLOUTGATE_<NAME>` or in the `--config` file."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import typing
from typing import Any

from pydantic import ValidationError

from rolloutgate.compiled import describe_build
from rolloutgate.config import GatewaySettings, load_settings
from rolloutgate.server.process import (
    event_loop_factory,
    keep_large_buffers_returnable,
    tune_gc,
    until_stop_signal,
)

__all__ = ("add_arguments", "run", "settings_table")


# Flags whose name is not the setting's: repeatable ones are named for one value.
_FLAG_NAMES = {"engines": "--engine", "api_keys": "--api-key", "trusted_networks": "--trust-network"}
_LIST_METAVARS = {"engines": "URL", "api_keys": "KEY", "trusted_networks": "CIDR"}
_NONE_WORDS = frozenset({"none", "null"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, from `GatewaySettings` itself: a new setting is a flag the moment it exists.

    Values go to pydantic as text, so a flag is checked exactly as the same value in the environment or the
    config file is; `none` clears an optional limit. Only flags given reach the settings (SUPPRESS)."""
    parser.add_argument(
        "--config", help="TOML or JSON file with any of the settings below (flags win, then environment)"
    )
    for name, field in GatewaySettings.model_fields.items():
        flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        help_text = (
            f"{field.description} (default {_default_text(field.get_default(call_default_factory=True))})"
        )
        annotation = field.annotation
        options: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if annotation is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is list:
            options["action"] = "append"
            options["metavar"] = _LIST_METAVARS.get(name, "VALUE")
        elif typing.get_origin(annotation) is typing.Literal:
            options["choices"] = list(typing.get_args(annotation))
        elif type(None) in typing.get_args(annotation):
            options["type"] = _optional
            options["metavar"] = "VALUE|none"
        parser.add_argument(flag, **options)


def settings_table() -> str:
    """Every setting as a Markdown table (flag, default, meaning): docs/gateway.md holds it verbatim, and a
    test keeps the two equal."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for name, field in GatewaySettings.model_fields.items():
        flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        default = _default_text(field.get_default(call_default_factory=True))
        meaning = str(field.description).replace("|", "\\|")
        rows.append(f"| `{flag}` | {default} | {meaning} |")
    return "\n".join(rows) + "\n"


def _optional(text: str) -> str | None:
    return None if text.strip().lower() in _NONE_WORDS else text


def _default_text(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, list):
        return "none" if not value else ", ".join(map(str, value))
    return str(value)


def run(args: argparse.Namespace) -> int:
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        settings = load_settings(flags, getattr(args, "config", None))
    except ValidationError as exc:
        print(f"rolloutgate serve: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    if settings.processes > 1:  # one port, N processes, each owning a share of the engines
        from rolloutgate.fleet.processes import serve_processes

        return serve_processes(settings)
    from rolloutgate.sessions.store import StateDirInUse

    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        try:
            runner.run(_serve(settings))
        except StateDirInUse as exc:  # a second gateway on one --state-dir: say so, no traceback
            print(f"rolloutgate serve: {exc}", file=sys.stderr)
            return 2
    return 0


async def _serve(settings: object) -> None:
    from rolloutgate.server.app import GatewayServer

    server = GatewayServer(settings)  # type: ignore[arg-type]
    url = await server.start()
    tune_gc()
    keep_large_buffers_returnable()
    logging.getLogger("rolloutgate").info("rolloutgate serving on %s", url)
    logging.getLogger("rolloutgate").info("modules %s", describe_build())
    print(f"rolloutgate serving on {url}", flush=True)
    # the first SIGTERM/SIGINT starts a graceful shutdown (in-flight requests get `shutdown_grace`), a
    # second one ends the grace period at once
    await until_stop_signal(server.hurry)
    await server.stop()
    print("rolloutgate stopped", flush=True)
