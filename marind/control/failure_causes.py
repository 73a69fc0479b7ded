"""Why a job's workers failed, in words a user acts on: the cause, its figures and the fix (pure).

The agent hands :func:`cause_of` what it knows of one failed worker: its rank and node, its
exit (code or signal), its own last exception line (``marind.agent.worker_errors``), the
memory cgroup's OOM evidence (``marind.agent.oom_watch``) and, for a collective timeout,
the ranks that stopped answering. :func:`cause_of` returns a :class:`Cause`: one kind of
:data:`CAUSES`, the line ``status`` and ``events`` show, the fix, and whether the error is
only the echo of another rank's failure (a peer that went away), which must not hide the
rank that failed first.

Recognised (docs/design.md §2, "Why it failed"):

==================  =======================================================================
kind                recognised from
==================  =======================================================================
oom_killed          exit by SIGKILL while the rank's memory cgroup counted an OOM kill
                    (``memory.oom_control`` ``oom_kill`` / ``memory.events`` ``oom_kill``),
                    or the kernel log named the pid
cuda_oom            ``torch.OutOfMemoryError: CUDA out of memory...`` (with its figures)
collective_timeout  gloo ``Timed out waiting Nms for recv/send``, NCCL's watchdog timeout
peer_lost           gloo ``Connection closed/reset by peer [host]:port``, NCCL remote errors
                    (an echo: another rank failed first)
nonfinite_loss      a NaN/inf loss (the worker's reports) or an error naming non-finite steps
data_missing        ``FileNotFoundError``/``No such file or directory``
tokenizer_mismatch  a token id past the vocabulary (embedding ``index out of range``,
                    ``vocab_size ... smaller than the data's vocabulary``)
killed              any other signal
error               any other exception line
exit                a non-zero exit without an exception line
==================  =======================================================================
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

#: Each kind and its fix, as ``status`` and ``events`` show them.
CAUSES: dict[str, str] = {
    "oom_killed": "the node ran out of host memory for this rank: lower its host memory (smaller micro-batch, "
                  "fewer data-loader workers, no full-model copies on the CPU) or give it more (raise the memory "
                  "cgroup's limit, fewer ranks per node)",
    "cuda_oom": "lower the micro-batch (the trainer's data.micro_batch), turn on activation checkpointing, or "
                "shard wider (more FSDP/tensor-parallel ranks); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                "helps when much is reserved but unallocated",
    "collective_timeout": "find why that rank stopped answering (its host, its stack dump, its network); raise "
                          "the collective timeout only if steps are that slow by design",
    "peer_lost": "another rank failed first: see that rank's reason (marind events JOB)",
    "nonfinite_loss": "lower the learning rate or warm it up longer, clip gradients, and check the data "
                      "around that step",
    "data_missing": "make the path exist on every node (a shared mount or a copy per node) or fix it in the "
                    "run.toml; relative paths start at [job] working_dir",
    "tokenizer_mismatch": "prepare the data with the model's tokenizer, or set the model's vocabulary size "
                          "to the data's (the trainer's model.vocab_size)",
    "killed": "find what sent the signal (the agent's log, the host's log, a person, a scheduler)",
    "error": "fix the error in the program or its inputs",
    "exit": "read the rank's output: marind logs JOB",
}


@dataclass(frozen=True)
class OomEvidence:
    """What says a SIGKILLed rank was killed by the kernel's OOM killer.

    Attributes:
        source: ``"cgroup"`` (the rank's memory cgroup counted an OOM kill) or ``"kernel log"``.
        cgroup: the memory cgroup's path, if known.
        limit_bytes: its memory limit, if it has one.
        peak_bytes: its peak usage (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``), if known.
        kills: OOM kills the cgroup counted since the rank started.
    """

    source: str
    cgroup: str | None = None
    limit_bytes: int | None = None
    peak_bytes: int | None = None
    kills: int = 1


@dataclass(frozen=True)
class Cause:
    """Why one rank failed.

    Attributes:
        kind: one of :data:`CAUSES`.
        what: what happened, where, with its figures (one line).
        fix: what to do.
        echo: the error is another rank's failure seen from here (a peer gone), not a cause.
    """

    kind: str
    what: str
    fix: str
    echo: bool = False

    @property
    def line(self) -> str:
        """The reason as shown: ``what; fix: ...``."""
        return f"{self.what}; fix: {self.fix}" if self.fix else self.what

    def to_dict(self) -> dict:
        """The fields an event or ``last_error`` record carries: ``cause``, ``fix``, ``echo``."""
        return {"cause": self.kind, "fix": self.fix, "echo": self.echo}


def describe_exit(exitcode: int) -> str:
    """An exit code in words: ``exit code 1``, ``killed by SIGKILL``."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def human_bytes(n: int | None) -> str:
    """``n`` bytes as ``512.0 MiB``; ``?`` for None."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


_SIZE = r"(\d+(?:\.\d+)? [KMGT]?i?B)"
_CUDA_OOM_RE = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|HIP out of memory")
_CUDA_FIGURES = (("tried to allocate", re.compile(r"Tried to allocate " + _SIZE)),
                 ("GPU total", re.compile(r"total capacity of " + _SIZE)),
                 ("free", re.compile(r"of which " + _SIZE + " is free")),
                 ("in use by the process", re.compile(r"this process has " + _SIZE + " memory in use")),
                 ("allocated by PyTorch", re.compile(_SIZE + " is allocated by PyTorch")),
                 ("reserved but unallocated", re.compile(_SIZE + " is reserved by PyTorch but unallocated")))
_GPU_RE = re.compile(r"\bGPU (\d+)\b")
_TIMEOUT_RE = re.compile(r"Timed out waiting (\d+)ms for (recv|send) operation|Watchdog caught collective "
                         r"operation timeout|Timeout\(ms\)=(\d+)|timed out after \d+|wait timeout after",
                         re.IGNORECASE)
_PEER_RE = re.compile(r"Connection (?:closed|reset) by peer(?: \[([^\]]+)\]:(\d+))?|ncclRemoteError|remote "
                      r"process exited|Read error \[([^\]]+)\]:\d+|Broken pipe", re.IGNORECASE)
_NONFINITE_RE = re.compile(r"non-finite|\bNaN\b|\bnan loss|\binf(?:inite)? loss|loss is (?:nan|inf)",
                           re.IGNORECASE)
_MISSING_RE = re.compile(r"FileNotFoundError|No such file or directory")
_PATH_RE = re.compile(r"'([^']+)'|\"([^\"]+)\"|(/\S+)")
_VOCAB_RE = re.compile(r"index out of range in self|srcIndex < srcSelectDimSize|vocab(?:ulary)?(?:_size)?\b.*"
                       r"(?:smaller|larger|mismatch|out of range|exceeds)|token id \d+ .*(?:out of range|>=)",
                       re.IGNORECASE)


def cuda_figures(text: str) -> dict[str, str]:
    """The figures of a CUDA out-of-memory message (the ones it has), by name."""
    out = {}
    gpu = _GPU_RE.search(text)
    if gpu:
        out["GPU"] = gpu.group(1)
    for name, pattern in _CUDA_FIGURES:
        m = pattern.search(text)
        if m:
            out[name] = m.group(1)
    return out


def error_kind(text: str) -> str:
    """The kind of :data:`CAUSES` an exception line belongs to (``error`` when none fits).

    Args:
        text: the exception line (``Type: message``), as long as it was printed.

    Returns:
        The kind.
    """
    if _CUDA_OOM_RE.search(text):
        return "cuda_oom"
    if _TIMEOUT_RE.search(text):
        return "collective_timeout"
    if _PEER_RE.search(text):
        return "peer_lost"
    if _VOCAB_RE.search(text):
        return "tokenizer_mismatch"
    if _MISSING_RE.search(text):
        return "data_missing"
    if _NONFINITE_RE.search(text):
        return "nonfinite_loss"
    return "error"


def peer_of(text: str) -> str | None:
    """The peer address a gloo connection error names (``127.0.0.1``), if any."""
    m = _PEER_RE.search(text)
    if m is None:
        return None
    return m.group(1) or m.group(3)


def _short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def where(rank: int | None, local_rank: int | None, node: str) -> str:
    """``rank 1 (local 1) on node-a``; ``local rank 1 on node-a`` when the global rank is not known."""
    if rank is None:
        return f"local rank {local_rank} on {node}" if local_rank is not None else f"a rank on {node}"
    return f"rank {rank} (local {local_rank}) on {node}" if local_rank is not None else f"rank {rank} on {node}"


def cause_of(*, node: str, exitcode: int | None, rank: int | None = None, local_rank: int | None = None,
             pid: int | None = None, error: str | None = None, oom: OomEvidence | None = None,
             silent_ranks: list[int] | None = None) -> Cause:
    """Why one rank failed.

    Args:
        node: its node.
        exitcode: its exit code (negative: the signal), None if not known.
        rank: its global rank, if known.
        local_rank: its rank on the node, if known.
        pid: its pid, if known.
        error: its own last exception line (never another rank's), if it printed one.
        oom: the kernel's OOM killer's evidence, if any (used for a SIGKILL only).
        silent_ranks: for a collective timeout, the ranks of the round that did not time out
            themselves (the ones that stopped answering), if known.

    Returns:
        The cause.
    """
    at = where(rank, local_rank, node)
    pid_part = f", pid {pid}" if pid else ""
    if exitcode == -signal.SIGKILL and oom is not None:
        figures = [f"memory cgroup {oom.cgroup}"] if oom.cgroup else []
        if oom.limit_bytes is not None:
            figures.append(f"limit {human_bytes(oom.limit_bytes)}")
        if oom.peak_bytes is not None:
            figures.append(f"peak {human_bytes(oom.peak_bytes)}")
        detail = f" ({', '.join(figures)})" if figures else ""
        return Cause("oom_killed", f"{at} was killed by the kernel's OOM killer (SIGKILL{pid_part}; seen in the "
                                   f"{oom.source}){detail}", CAUSES["oom_killed"])
    if error:
        kind = error_kind(error)
        if kind == "cuda_oom":
            figs = cuda_figures(error)
            shown = ", ".join(f"{k} {v}" for k, v in figs.items())
            return Cause(kind, f"{at}: CUDA out of memory ({shown})" if shown else f"{at}: CUDA out of memory",
                         CAUSES[kind])
        if kind == "collective_timeout":
            who = (f"rank {', '.join(map(str, silent_ranks))} stopped answering" if silent_ranks
                   else "a rank on another node stopped answering (no rank here did)")
            return Cause(kind, f"{at}: a collective timed out: {who} ({_short(error, 160)})", CAUSES[kind])
        if kind == "peer_lost":
            peer = peer_of(error)
            gone = f"its peer at {peer} went away" if peer else "a peer went away"
            return Cause(kind, f"{at}: {gone} ({_short(error, 160)})", CAUSES[kind], echo=True)
        return Cause(kind, f"{at}: {_short(error)}", CAUSES[kind])
    if exitcode is not None and exitcode < 0:
        return Cause("killed", f"{at} was {describe_exit(exitcode)}" + (f" (pid {pid})" if pid else ""),
                     CAUSES["killed"])
    code = describe_exit(exitcode) if exitcode is not None else "failed"
    return Cause("exit", f"{at} ended with {code}", CAUSES["exit"])


def keep_first(old: dict | None, new: dict, window_s: float = 120.0) -> bool:
    """Should ``new`` replace ``old`` as the job's ``last_error``? Not when ``new`` is an echo
    (a peer gone) of a failure ``old`` already names as a cause within ``window_s``.

    Args:
        old: the recorded ``last_error`` (None: none).
        new: the one to write (``{"line", "at", "echo", ...}``).
        window_s: how close in time the two must be to belong to one failure.

    Returns:
        True to write ``new``.
    """
    if not old or not new.get("echo") or old.get("echo"):
        return True
    try:
        return abs(float(new.get("at", 0)) - float(old.get("at", 0))) > window_s
    except (TypeError, ValueError):
        return True


def nonfinite_cause(step: int, value: str, node: str, rank: int = 0) -> Cause:
    """A loss that became ``value`` (``nan``, ``inf``) at ``step``."""
    return Cause("nonfinite_loss", f"the loss became {value} at step {step} ({where(rank, None, node)})",
                 CAUSES["nonfinite_loss"])
