"""`marind` command line: a thin layer over the libraries.

Each command group lives in ``marind/commands/<group>.py`` and exposes
``register(subparsers)``; the handler it sets returns an exit code.
Errors are mapped to exit codes here and only here (docs/design.md §5):
0 ok, 1 failed, 2 bad input/usage, 3 control plane unreachable,
4 job failed, 5 refused by etcd's access control (roles). User errors print one line on stderr, with a traceback
only when ``MARIND_DEBUG=1``. A reader that stops reading (``marind status
| head -1``) ends the command quietly with exit 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from ckpt_store.errors import CheckpointError
from marind.core.errors import MarindError

COMMAND_MODULES = ("agent", "jobs", "events", "ckpt", "data", "doctor", "slurm", "auth", "tensorboard")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors: one line, exit 2
        sys.stderr.write(f"Error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from marind import __version__

    parser = _Parser(prog="marind", description="Fault-tolerant elastic training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"marind {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"marind.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        rc = int(args.handler(args) or 0)
        sys.stdout.flush()          # a closed pipe shows here, not at interpreter exit
        return rc
    except BrokenPipeError:
        _drop_stdout()
        return 0
    except KeyboardInterrupt:
        return 130
    except MarindError as exc:
        return _fail(exc, exc.exit_code)
    except CheckpointError as exc:
        return _fail(exc, exc.exit_code)
    except (FileNotFoundError, PermissionError, ValueError) as exc:
        return _fail(exc, 2)
    except Exception as exc:  # noqa: BLE001 - the last line of defence of a CLI
        return _fail(exc, 1, unexpected=True)


def _drop_stdout() -> None:
    """The reader of stdout went away: send what is left to /dev/null (no second error at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def _fail(exc: BaseException, code: int, unexpected: bool = False) -> int:
    if os.environ.get("MARIND_DEBUG") == "1":
        traceback.print_exception(exc)
    message = str(exc) or type(exc).__name__
    if unexpected:
        message = f"{type(exc).__name__}: {message} (rerun with MARIND_DEBUG=1 for a traceback)"
    sys.stderr.write(f"Error: {message.splitlines()[0] if message else message}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
