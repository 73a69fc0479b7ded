"""``should_stop()``: a SIGTERM (or SIGINT) that reached any rank, agreed by all ranks at a step boundary.

The agent stops a job (``marind cancel``, a drain, a resize) by sending SIGTERM to its
workers. A program that calls :func:`should_stop` once per step, on every rank at the same
point, leaves its loop together with the others: each call all-reduces one flag (MAX) on
the default process group, so every rank gets the same answer at the same step, and the
program can save a checkpoint (a collective) before it exits.

The handler is installed by :func:`install`, or by the first :func:`should_stop`; a signal
that arrives before either ends the process the default way. A second signal after the
first also ends it the default way (a stuck shutdown can still be stopped).
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist


class StopFlag:
    """Set by SIGTERM/SIGINT once :meth:`install` ran; a second signal stops the process at once."""

    def __init__(self) -> None:
        self.requested = False
        self.installed = False

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this process (idempotent).

        Raises:
            RuntimeError: called from a thread other than the main thread (Python runs
                signal handlers there only).
        """
        if self.installed:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("marind.worker.install() must run in the main thread (signal handlers live there); "
                               "call it at the start of the program")
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        self.installed = True

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:  # a second signal: stop now, the default way
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = True


def collective_device() -> torch.device:
    """The device a small all-reduce on the default group runs on (CUDA under NCCL, else CPU)."""
    if "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(flag: bool) -> bool:
    """Whether ``flag`` is set on any rank of the default group (collective; local without one).

    Args:
        flag: this rank's flag.

    Returns:
        True on every rank if it was True on one.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


_flag = StopFlag()
_agreed = False


def stop_flag() -> StopFlag:
    """This process's stop flag (the one :func:`install` arms and :func:`should_stop` reads)."""
    return _flag


def install() -> None:
    """Install the SIGTERM/SIGINT handler now (otherwise the first :func:`should_stop` does).

    Raises:
        RuntimeError: not called from the main thread.
    """
    _flag.install()


def should_stop() -> bool:
    """True once a SIGTERM or SIGINT reached any rank (collective: every rank calls it at the same points).

    Call it once per step, on every rank, at the same place in the loop (a step boundary):
    it all-reduces one flag on the default process group. Once True it stays True without
    another collective.

    Returns:
        Whether to leave the training loop now.

    Raises:
        RuntimeError: the first call is not in the main thread (see :func:`install`).
    """
    global _agreed
    _flag.install()
    if not _agreed:
        _agreed = agree(_flag.requested)
    return _agreed
