"""The ``devmap-shims`` command (also ``python -m devmap_shims``).

One module per subcommand, each with ``add_arguments(parser)`` and ``run(args) -> exit code``;
they share :mod:`._output` (exit codes, :class:`UsageError`, tables, JSON).

Exit codes: 0 success, 1 the command ran and found a problem (``demo`` with a failing scenario or
a shim module that fails to import, ``plan`` with a degenerate map), 2 usage error (unknown
command, bad arguments, unreadable input).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from typing import Iterator, Optional, Sequence

from devmap_shims.cli._output import EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, UsageError

#: (name, module, add_arguments, run, help): the subcommands, in the order ``--help`` lists them.
COMMANDS = (
    ("doctor", "devmap_shims.cli.doctor", "add_arguments", "run", "versions, devices, applicable bugs and the state of every shim"),
    ("matrix", "devmap_shims.cli.matrix", "add_matrix_arguments", "run_matrix", "list the known bugs"),
    ("explain", "devmap_shims.cli.matrix", "add_explain_arguments", "run_explain",
     "one known bug in full, with its upstream links and fix; or one shim with the ranges of its rows"),
    ("run", "devmap_shims.cli.run", "add_arguments", "run", "run a command with DEVMAP_SHIMS=1"),
    ("plan", "devmap_shims.cli.plan", "add_arguments", "run",
     "the device map from_pretrained would compute, with and without the shims"),
    ("demo", "devmap_shims.cli.demo", "add_arguments", "run",
     "replay the known bugs on simulated GPUs, without and with the shims"),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    from devmap_shims import __version__

    parser = _Parser(prog="devmap-shims", description="Keep the Hugging Face stack placing tensors on the right GPU.")
    parser.add_argument("--version", action="version", version=f"devmap-shims {__version__}")
    sub = parser.add_subparsers(dest="command_name", metavar="COMMAND", parser_class=_Parser)
    for name, module_name, add, run, help_text in COMMANDS:
        module = importlib.import_module(module_name)
        # `run` passes everything after it to the command, options included (its -h is its own)
        extra = {"prefix_chars": "\0", "add_help": False} if name == "run" else {}
        command = sub.add_parser(name, help=help_text, **extra)
        getattr(module, add)(command)
        command.set_defaults(func=getattr(module, run))
    return parser


@contextlib.contextmanager
def _streams() -> Iterator[None]:
    """The command's view of stdout and stderr, given back as it was when the command ends (a host
    program may call :func:`main` in-process):

    * on a stream whose encoding is not UTF-8 (an ASCII locale, ``PYTHONIOENCODING=ascii``), a
      character it lacks (a bug's ``·``, a path's ``ü``) is printed as a backslash escape instead
      of ending the command part-way with UnicodeEncodeError;
    * a closed stderr (``2>&-``: ``sys.stderr`` is None) takes progress lines and errors into a
      sink, where ``print(file=None)`` would write them onto stdout, into the JSON.
    """
    import codecs
    import os

    changed = []
    for stream in (sys.stdout, sys.stderr):
        try:
            narrow = stream.errors in ("strict", "surrogateescape") and (
                codecs.lookup(stream.encoding).name != "utf-8")
        except (AttributeError, LookupError, TypeError):
            continue
        if narrow and callable(getattr(stream, "reconfigure", None)):
            changed.append((stream, stream.errors))
            stream.reconfigure(errors="backslashreplace")
    sink = open(os.devnull, "w") if sys.stderr is None else None
    if sink is not None:
        sys.stderr = sink
    try:
        yield
    finally:
        if sink is not None and sys.stderr is sink:
            sys.stderr = None
            sink.close()
        for stream, errors in changed:
            try:
                stream.reconfigure(errors=errors)
            except (AttributeError, ValueError):  # closed by the command's own output
                pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    with _streams():
        return _main(argv)


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from devmap_shims.shims.config import UnknownShimId

    try:
        return int(args.func(args) or 0)
    except (UsageError, UnknownShimId) as exc:  # strict mode refusing DEVMAP_SHIMS_DISABLE=typo
        print(f"devmap-shims {args.command_name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `devmap-shims matrix | head`
        return EXIT_OK
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, not a traceback; DEVMAP_SHIMS_LOG=debug shows it
        import os

        if os.environ.get("DEVMAP_SHIMS_LOG", "").strip().lower() == "debug":
            raise
        text = " ".join(str(exc).split())[:300]
        print(f"devmap-shims {args.command_name}: error: {type(exc).__name__}: {text} "
              "(DEVMAP_SHIMS_LOG=debug shows the traceback)", file=sys.stderr)
        return EXIT_PROBLEM


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
