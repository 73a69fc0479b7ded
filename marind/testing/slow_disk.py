"""A slow disk for the checkpoint benchmarks, set up by the bench and removed afterwards, even on failure.

``slow_disk(base, size_bytes, rate_bps)`` makes a sparse image file under
``base`` (never tmpfs: the image must live on a real disk), attaches it to a
loop device (``--direct-io=on``: no second page cache under the loop),
formats it ext4, mounts it, and caps the loop device's reads and writes at
``rate_bps`` bytes/s with the block I/O throttle:

* cgroup v1 (``/sys/fs/cgroup/blkio``): a rule in the root group of the blkio
  hierarchy. v1 charges buffered writeback to the root group, so the cap holds
  for page-cache writes too, whoever dirtied them; the device is the bench's
  own, so the rule slows nobody else.
* cgroup v2 (``io`` in ``/sys/fs/cgroup/cgroup.controllers``): ``io.max`` of a
  child group that this process joins before it starts the ranks (children
  inherit it), left again at the end.

Everything is undone in reverse order on the way out (exception, Ctrl-C,
SIGTERM). Where root, a loop device, ext4 or the throttle is missing it raises
``SlowDiskUnavailable`` with one line naming what and the fix.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

V1_BLKIO = "/sys/fs/cgroup/blkio"
V2_ROOT = "/sys/fs/cgroup"


class SlowDiskUnavailable(RuntimeError):
    """This machine cannot give the bench its slow target (the message says why and the fix)."""


@dataclass(frozen=True)
class SlowDisk:
    """A mounted, throttled filesystem: ``path`` to write under, its cap and how it is applied."""

    path: str
    rate_bps: int
    device: str
    throttle: str          # "cgroup-v1 blkio" or "cgroup-v2 io.max"


def fs_type(path: str) -> str:
    """The filesystem type holding ``path`` (the longest mount point above it in /proc/self/mounts)."""
    real, best, kind = os.path.realpath(path), "", ""
    with open("/proc/self/mounts") as fh:
        for line in fh:
            fields = line.split()
            mnt = fields[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, fields[2]
    return kind


def _run(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlowDiskUnavailable(f"slow target: {cmd[0]} failed ({exc})") from exc
    if out.returncode != 0:
        raise SlowDiskUnavailable(f"slow target: {' '.join(cmd[:2])} failed: {out.stderr.strip()[:200]}")
    return out.stdout.strip()


def _check_prereqs(base: str) -> None:
    if os.geteuid() != 0:
        raise SlowDiskUnavailable("slow target needs root (loop device, mount, blkio throttle): "
                                  "run the bench as root or pass --no-slow")
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            raise SlowDiskUnavailable(f"slow target needs {tool}: install util-linux/e2fsprogs or pass --no-slow")
    if fs_type(base) in ("tmpfs", "ramfs", ""):
        raise SlowDiskUnavailable(f"slow target: {base} is on {fs_type(base) or 'an unknown fs'}, not a disk: "
                                  "pass --slow-base DIR on a real disk")


def _dev_numbers(device: str) -> str:
    with open(f"/sys/block/{os.path.basename(device)}/dev") as fh:
        return fh.read().strip()


def _throttle(stack: contextlib.ExitStack, majmin: str, rate: int) -> str:
    """Cap ``majmin`` at ``rate`` bytes/s both ways; the undo goes on ``stack``. Returns how."""
    if os.path.exists(f"{V1_BLKIO}/blkio.throttle.write_bps_device"):
        def set_v1(value: int) -> None:
            for kind in ("write", "read"):
                with open(f"{V1_BLKIO}/blkio.throttle.{kind}_bps_device", "w") as fh:
                    fh.write(f"{majmin} {value}")
        set_v1(rate)
        stack.callback(set_v1, 0)
        return "cgroup-v1 blkio"
    controllers = ""
    with contextlib.suppress(OSError):
        controllers = open(f"{V2_ROOT}/cgroup.controllers").read()
    if "io" not in controllers.split():
        raise SlowDiskUnavailable("slow target needs the block I/O throttle (cgroup v1 blkio or the v2 io "
                                  "controller), which this machine lacks: pass --no-slow")
    group = f"{V2_ROOT}/marind-slow-{os.getpid()}"
    with open("/proc/self/cgroup") as fh:
        origin = V2_ROOT + next(line.split(":", 2)[2].strip() for line in fh if line.startswith("0::"))
    with contextlib.suppress(OSError):
        with open(f"{V2_ROOT}/cgroup.subtree_control", "w") as fh:
            fh.write("+io")
    os.mkdir(group)
    stack.callback(os.rmdir, group)
    with open(f"{group}/io.max", "w") as fh:
        fh.write(f"{majmin} rbps={rate} wbps={rate}")

    def leave() -> None:
        with open(f"{origin.rstrip('/')}/cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))
    with open(f"{group}/cgroup.procs", "w") as fh:
        fh.write(str(os.getpid()))
    stack.callback(leave)
    return "cgroup-v2 io.max"


@contextlib.contextmanager
def slow_disk(base: str, size_bytes: int, rate_bps: int) -> Iterator[SlowDisk]:
    """A throttled ext4 filesystem under ``base`` for the duration of the ``with`` block.

    Args:
        base: a directory on a real disk for the image file and the mount point.
        size_bytes: the filesystem's size (the image is sparse).
        rate_bps: the read and write cap, bytes/s.

    Yields:
        The mounted ``SlowDisk``.

    Raises:
        SlowDiskUnavailable: no root, no loop device or mkfs.ext4, tmpfs ``base``, no throttle.
    """
    _check_prereqs(base)
    tag = f"marind-slow-{os.getpid()}"
    image, mnt = os.path.join(base, f"{tag}.img"), os.path.join(base, f"{tag}.mnt")
    with contextlib.ExitStack() as stack:
        with open(image, "wb") as fh:
            fh.truncate(size_bytes)
        stack.callback(os.remove, image)
        device = _run(["losetup", "--find", "--show", "--direct-io=on", image])
        stack.callback(_run, ["losetup", "-d", device])
        _run(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device])
        os.makedirs(mnt)
        stack.callback(os.rmdir, mnt)
        _run(["mount", device, mnt])
        stack.callback(_umount, mnt)
        how = _throttle(stack, _dev_numbers(device), rate_bps)
        yield SlowDisk(path=mnt, rate_bps=rate_bps, device=device, throttle=how)


def _umount(mnt: str) -> None:
    """Unmount, lazily if something still holds it (a rank killed mid-write)."""
    os.sync()
    if subprocess.run(["umount", mnt], capture_output=True).returncode != 0:
        _run(["umount", "-l", mnt])
