"""``devmap-shims run -- CMD``: run a command with ``DEVMAP_SHIMS=1``."""

from __future__ import annotations

import argparse
import os

from devmap_shims.cli._output import EXIT_OK, UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("command", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("run needs a command: devmap-shims run -- python serve.py")
    env = dict(os.environ)
    env["DEVMAP_SHIMS"] = "1"
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        raise UsageError(f"cannot run {command[0]!r}: {exc.strerror}") from None
    return EXIT_OK  # pragma: no cover
