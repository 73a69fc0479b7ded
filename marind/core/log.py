"""Logging, configured once for every marind package.

structlog renders JSON lines when stderr is not a terminal (daemon, CI,
journald) and coloured key=value lines when a person is watching.
Library code calls ``get_logger(__name__)`` and binds context
(``job``, ``node``, ``rank``, ``step``); only entry points call
``configure_logging``.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog
from structlog.typing import Processor

_configured = False


def configure_logging(level: str | None = None, json: bool | None = None) -> None:
    """Set up structlog and the stdlib root logger (idempotent).

    ``level`` defaults to ``MARIND_LOG_LEVEL`` or INFO; ``json`` defaults to
    ``MARIND_LOG_JSON`` if set, else True when stderr is not a TTY.
    """
    global _configured
    level_name = (level or os.environ.get("MARIND_LOG_LEVEL") or "INFO").upper()
    numeric = logging.getLevelName(level_name)
    if not isinstance(numeric, int):
        numeric = logging.INFO
    if json is None:
        env = os.environ.get("MARIND_LOG_JSON")
        json = (env not in ("0", "false", "")) if env is not None else not sys.stderr.isatty()

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: list[Processor]
    if json:
        renderer = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    _configured = True


def get_logger(name: str | None = None, **context):
    """A structlog logger; configures defaults on first use if nobody did."""
    if not _configured:
        configure_logging()
    logger = structlog.get_logger()
    if name:
        context = {"logger": name, **context}
    return logger.bind(**context) if context else logger
