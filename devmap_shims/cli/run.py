"""``devmap-shims run -- CMD``: run a command with ``DEVMAP_SHIMS=1``.

``DEVMAP_SHIMS=0`` in the environment is the kill switch and beats ``run``: the command runs
without shims (said once on stderr). A command that does not exist exits 127, one that is not
executable 126, as a shell would.
"""

from __future__ import annotations

import argparse
import os
import sys

from devmap_shims.cli._output import EXIT_OK, UsageError
from devmap_shims.shims.config import ENV_ENABLE, flag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "devmap-shims run [-h] -- COMMAND [ARG ...]"
    parser.description = (
        "Run COMMAND with DEVMAP_SHIMS=1, so that every Python process it starts installs the shims "
        "(DEVMAP_SHIMS=0 in the environment beats it). Exits with COMMAND's status; 127 when it does "
        "not exist, 126 when it cannot be run."
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command and its arguments, after --")
    parser.set_defaults(run_parser=parser)


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] in (["-h"], ["--help"]):  # run's own help; `run -- --help` runs a command "--help"
        args.run_parser.print_help()
        return EXIT_OK
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("run needs a command: devmap-shims run -- python serve.py")
    env = dict(os.environ)
    if flag(env.get(ENV_ENABLE)) is False:
        print(f"devmap-shims run: {ENV_ENABLE}={env[ENV_ENABLE]!r} (the kill switch) beats run: "
              f"{command[0]} runs without shims", file=sys.stderr)
    else:
        env[ENV_ENABLE] = "1"
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        missing = isinstance(exc, FileNotFoundError)
        print(f"devmap-shims run: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127 if missing else 126
    return EXIT_OK  # pragma: no cover
