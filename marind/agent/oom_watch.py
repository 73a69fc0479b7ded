"""Was a SIGKILLed worker killed by the kernel's OOM killer? Its memory cgroup's counters, or the kernel log.

An exit by SIGKILL says nothing of who sent it. The kernel counts its OOM kills per memory
cgroup: cgroup v1 ``memory.oom_control`` (``oom_kill N``; ``memory.failcnt`` counts hits of the
limit), cgroup v2 ``memory.events`` (``oom_kill N``). :class:`OomWatch` notes each worker's
memory cgroup and its count while the worker lives (``note``, every tick; a worker that moves
to another cgroup is noted there anew); when the worker exits by SIGKILL, ``evidence`` compares
the count now with the one noted: more kills mean the OOM killer. Where the counters say
nothing (no cgroup, a count that did not move), the kernel log (``/dev/kmsg``, readable by
root) is searched for the pid (``Killed process PID``).

The parsers are pure; reading ``/proc`` and ``/sys/fs/cgroup`` is confined to the class.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from marind.control.failure_causes import OomEvidence

CGROUP_ROOT = Path("/sys/fs/cgroup")
#: A v1 limit at or above this is "no limit" (the kernel's unlimited value rounded to pages).
_UNLIMITED = 1 << 60
_KILLED_RE = re.compile(r"Killed process (\d+)|oom-kill:.*\bpid=(\d+)")


def memory_cgroup(proc_cgroup: str) -> tuple[str, str] | None:
    """The memory cgroup in a ``/proc/PID/cgroup`` text: ``("v1", path)`` or ``("v2", path)``.

    Args:
        proc_cgroup: the file's text (``4:memory:/a/b`` lines on v1, ``0::/a/b`` on v2).

    Returns:
        The version and the path, or None when the text names none.
    """
    unified = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            return "v1", parts[2]
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2]
    return ("v2", unified) if unified is not None else None


def cgroup_dir(version: str, path: str, root: Path = CGROUP_ROOT) -> Path:
    """The directory of a memory cgroup: ``{root}/memory{path}`` (v1), ``{root}{path}`` (v2)."""
    return (root / "memory" if version == "v1" else root) / path.lstrip("/")


def oom_kills(text: str) -> int | None:
    """``oom_kill N`` of a v1 ``memory.oom_control`` or v2 ``memory.events`` text; None without it."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def limit_bytes(text: str) -> int | None:
    """A memory limit file's value (v1 ``memory.limit_in_bytes``, v2 ``memory.max``); None: no limit."""
    value = text.strip()
    if not value.isdigit():
        return None                 # v2 "max"
    n = int(value)
    return None if n >= _UNLIMITED else n


def kmsg_killed(lines: list[str], pid: int) -> bool:
    """Does the kernel log name ``pid`` as killed by the OOM killer?"""
    for line in lines:
        if "oom" not in line.lower() and "Out of memory" not in line:
            continue
        for m in _KILLED_RE.finditer(line):
            if int(m.group(1) or m.group(2)) == pid:
                return True
    return False


@dataclass
class _Noted:
    version: str
    path: str
    kills: int | None
    failcnt: int | None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


#: ``PF_EXITING`` in ``/proc/PID/stat``'s flags: the task is exiting.
_PF_EXITING = 0x4


def _exited(proc: Path, pid: int) -> bool:
    """Is ``pid`` exiting, a zombie or gone? Its ``/proc/PID/cgroup`` may then name the root cgroup
    (the kernel moves an exiting task there), not the one it lived in."""
    stat = _read(proc / str(pid) / "stat")
    fields = stat.rpartition(")")[2].split() if stat else []
    if len(fields) < 7 or fields[0] in ("Z", "X"):
        return True
    return fields[6].isdigit() and bool(int(fields[6]) & _PF_EXITING)


class OomWatch:
    """Each worker's memory cgroup and OOM count, for telling an OOM kill from another SIGKILL.

    Args:
        root: where the cgroup file systems are mounted.
        proc: where ``/proc`` is.
        kmsg: the kernel log device (None: not read).
    """

    def __init__(self, root: Path = CGROUP_ROOT, proc: Path = Path("/proc"), kmsg: Path | None = Path("/dev/kmsg")):
        self.root, self.proc, self.kmsg = root, proc, kmsg
        self._noted: dict[int, _Noted] = {}

    def note(self, pids: list[int]) -> None:
        """Note the memory cgroup and its counts of each live worker ``pids`` (anew when it moved)."""
        for pid in pids:
            text = _read(self.proc / str(pid) / "cgroup")
            where = memory_cgroup(text) if text else None
            if where is None or _exited(self.proc, pid):
                continue              # an exited task shows the root cgroup: keep where it lived
            old = self._noted.get(pid)
            if old is not None and (old.version, old.path) == where:
                continue
            self._noted[pid] = _Noted(where[0], where[1], *self._counts(*where))
        live = set(pids)
        for pid in [p for p in self._noted if p not in live and len(self._noted) > 4 * max(len(live), 1)]:
            del self._noted[pid]          # bounded: old generations go

    def _counts(self, version: str, path: str) -> tuple[int | None, int | None]:
        d = cgroup_dir(version, path, self.root)
        text = _read(d / ("memory.oom_control" if version == "v1" else "memory.events"))
        fail = _read(d / "memory.failcnt") if version == "v1" else None
        return (oom_kills(text) if text else None,
                int(fail) if fail and fail.strip().isdigit() else None)

    def evidence(self, pid: int) -> OomEvidence | None:
        """Why ``pid`` (a worker that exited by SIGKILL) died, if the OOM killer did it.

        Returns:
            The evidence, or None when neither the cgroup nor the kernel log says so.
        """
        noted = self._noted.get(pid)
        if noted is not None:
            kills, failcnt = self._counts(noted.version, noted.path)
            d = cgroup_dir(noted.version, noted.path, self.root)
            more_kills = kills is not None and noted.kills is not None and kills > noted.kills
            # an old v1 kernel without oom_kill: the limit was hit (failcnt moved) just before a SIGKILL
            hit_limit = (kills is None and failcnt is not None and noted.failcnt is not None
                         and failcnt > noted.failcnt)
            if more_kills or hit_limit:
                v1 = noted.version == "v1"
                limit = _read(d / ("memory.limit_in_bytes" if v1 else "memory.max"))
                peak = _read(d / ("memory.max_usage_in_bytes" if v1 else "memory.peak"))
                return OomEvidence("cgroup", cgroup=noted.path, limit_bytes=limit_bytes(limit) if limit else None,
                                   peak_bytes=int(peak) if peak and peak.strip().isdigit() else None,
                                   kills=(kills - noted.kills) if more_kills and kills is not None
                                   and noted.kills is not None else 1)
        if self.kmsg is not None and kmsg_killed(self._kmsg_lines(), pid):
            return OomEvidence("kernel log", cgroup=noted.path if noted else None)
        return None

    def _kmsg_lines(self, limit: int = 20000) -> list[str]:
        """The kernel log's records (non-blocking; [] when it cannot be read)."""
        if self.kmsg is None:
            return []
        try:
            fd = os.open(self.kmsg, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return []
        lines: list[str] = []
        try:
            for _ in range(limit):
                try:
                    data = os.read(fd, 8192)
                except BlockingIOError:
                    break
                except OSError:           # EPIPE: a record was overwritten while reading; go on
                    continue
                if not data:
                    break
                lines.append(data.decode(errors="replace"))
        finally:
            os.close(fd)
        return lines
