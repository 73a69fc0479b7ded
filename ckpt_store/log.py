"""ckpt_store's loggers: structlog, configured by the application, never by ckpt_store.

Library code calls ``get_logger(__name__)`` and logs events with key=value
context (``step``, ``rank``). ckpt_store never configures logging: where the
process has configured structlog (marind does, at its entry points), every
line goes through that configuration. Where nobody has (a script using
ckpt_store alone, a CLI that prints JSON on stdout, the writer process),
lines go to stderr, never stdout: JSON lines unless stderr is a terminal,
INFO and above. The choice is made per line, so configuring structlog after
ckpt_store was imported takes effect at once.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


class CkptLogger:
    """A logger that resolves its destination per line (the application's structlog setup,
    else stderr); ``bind`` returns a new one with more context."""

    def __init__(self, context: dict[str, Any]):
        self._context = context

    def bind(self, **context: Any) -> CkptLogger:
        """A logger with ``context`` added to every line."""
        return CkptLogger({**self._context, **context})

    def debug(self, event: str, **kw: Any) -> Any:
        return self._target().debug(event, **kw)

    def info(self, event: str, **kw: Any) -> Any:
        return self._target().info(event, **kw)

    def warning(self, event: str, **kw: Any) -> Any:
        return self._target().warning(event, **kw)

    def error(self, event: str, **kw: Any) -> Any:
        return self._target().error(event, **kw)

    def _target(self) -> Any:
        base = structlog.get_logger("ckpt_store") if structlog.is_configured() else _stderr_logger()
        return base.bind(**self._context) if self._context else base


def get_logger(name: str | None = None, **context: Any) -> CkptLogger:
    """A logger for a ckpt_store module.

    Args:
        name: the module's name (``__name__``), logged as ``logger``.
        **context: more key=value pairs bound to every line.

    Returns:
        A ``CkptLogger``: through structlog's configuration where the process has
        one, else to stderr.
    """
    if name:
        context = {"logger": name, **context}
    return CkptLogger(context)


def _stderr_logger() -> Any:
    """The logger for a process that configured no structlog: stderr, JSON unless a terminal.
    A logger of its own (``wrap_logger``): the global configuration stays untouched. Built
    per line, around whatever ``sys.stderr`` is then (a test may have swapped it)."""
    tty = sys.stderr.isatty()
    renderer: list[Any] = ([structlog.dev.ConsoleRenderer(colors=True)] if tty else
                           [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()])
    return structlog.wrap_logger(
        structlog.PrintLogger(sys.stderr),
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.StackInfoRenderer(), *renderer],
        wrapper_class=_INFO_AND_ABOVE)


_INFO_AND_ABOVE = structlog.make_filtering_bound_logger(logging.INFO)
