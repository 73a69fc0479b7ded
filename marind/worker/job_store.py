"""``checkpoints()``: the job's ``ckpt_store.CheckpointStore``, from ``[checkpoint]`` of its stored spec.

The agent stores the job's spec in the run dir as ``run.toml`` and points ``MARIND_RUN_TOML``
at it; :func:`run_toml_path` reads that variable, else ``$MARIND_RUN_DIR/run.toml``. Only the
``[checkpoint]`` table is read, with the spec's own parser (``marind.core.spec.CheckpointSpec``:
the same keys, defaults and errors as ``marind submit``): ``url``, ``keep_last``, ``keep_every``.
A bare local path as ``url`` means a directory (``file://`` + its absolute path).
"""

from __future__ import annotations

import os
import threading
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from marind.core import workerenv as WE
from marind.core.errors import SpecError
from marind.core.schema import parse_table
from marind.core.spec import CheckpointSpec

if TYPE_CHECKING:
    from ckpt_store import CheckpointStore


class NoCheckpoints(SpecError):
    """The job's spec has no ``[checkpoint] url``, or the worker does not run under marind."""


def run_toml_path(environ: dict[str, str] | None = None) -> Path:
    """The job's stored spec: ``MARIND_RUN_TOML``, else ``$MARIND_RUN_DIR/run.toml``.

    Args:
        environ: the environment to read; ``os.environ`` when None.

    Returns:
        The path (not checked).

    Raises:
        NoCheckpoints: neither variable is set (not started by marind).
    """
    env = os.environ if environ is None else environ
    if env.get(WE.RUN_TOML):
        return Path(env[WE.RUN_TOML])
    if env.get(WE.RUN_DIR):
        return Path(env[WE.RUN_DIR]) / "run.toml"
    raise NoCheckpoints(f"no job spec: neither {WE.RUN_TOML} nor {WE.RUN_DIR} is set; run the program "
                        f"under marind, or set {WE.RUN_TOML} to a run.toml with a [checkpoint] url")


def checkpoint_spec(text: str, source: str = "run.toml") -> CheckpointSpec:
    """The ``[checkpoint]`` table of a spec's TOML text (other tables are not looked at).

    Args:
        text: the run.toml's text.
        source: its name, for error messages.

    Returns:
        The parsed table (defaults where absent).

    Raises:
        SpecError: bad TOML, or a bad ``[checkpoint]`` key or value (named).
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: {exc}; fix the syntax at that line") from exc
    spec, _ = parse_table(CheckpointSpec, data.get("checkpoint", {}), "checkpoint")
    return spec


def store_url(url: str, base: Path | None = None) -> str:
    """A ``[checkpoint] url`` as a store URL: a bare path becomes ``file://`` + its absolute path.

    Args:
        url: the configured value (``s3://...``, ``file://...`` or a path).
        base: the directory a relative path is taken from (the working directory when None).

    Returns:
        The URL.
    """
    if not url or "://" in url:
        return url
    path = Path(url)
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    return "file://" + os.path.abspath(path)


_lock = threading.Lock()
_store: tuple[int, str, CheckpointStore] | None = None


def checkpoints() -> CheckpointStore:
    """The job's checkpoint store (one per process, made on first use).

    Returns:
        A ``ckpt_store.CheckpointStore`` at ``[checkpoint] url`` with the job's retention
        (``keep_last``, ``keep_every``).

    Raises:
        NoCheckpoints: not under marind, or the spec has no ``[checkpoint] url``.
        SpecError: the spec cannot be read or its ``[checkpoint]`` table is malformed.
    """
    global _store
    path = run_toml_path()
    with _lock:
        if _store is not None and _store[0] == os.getpid() and _store[1] == str(path):
            return _store[2]
        try:
            text = path.read_text()
        except OSError as exc:
            raise SpecError(f"cannot read the job's spec {path}: {exc.strerror or exc}") from exc
        c = checkpoint_spec(text, str(path))
        if not c.url:
            raise NoCheckpoints(f"the job has no [checkpoint] url ({path}); add one to its run.toml, "
                                f"e.g. url = \"s3://bucket/run\" or a shared directory")
        from ckpt_store import CheckpointStore

        store = CheckpointStore(store_url(c.url), keep_last=c.keep_last or None, keep_every=c.keep_every or None)
        _store = (os.getpid(), str(path), store)
        return store
