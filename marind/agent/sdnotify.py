"""systemd's notify protocol (sd_notify) without libsystemd.

``notify("READY=1")`` sends one datagram to ``$NOTIFY_SOCKET``; it is a
no-op (returns False) when the variable is unset, so the agent runs the
same outside systemd. A leading ``@`` names an abstract socket.
``watchdog_interval()`` is half of ``$WATCHDOG_USEC`` (when it is meant
for this pid), the pace at which ``WATCHDOG=1`` should be sent.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, address: str | None = None):
        address = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self.address = address or None
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def _target(self) -> str | bytes:
        assert self.address is not None
        if self.address.startswith("@"):
            return b"\0" + self.address[1:].encode()
        return self.address

    def notify(self, *lines: str) -> bool:
        if not self.enabled:
            return False
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            # never block the caller (the supervision loop) on a slow or full receiver
            self._sock.sendto("\n".join(lines).encode(), socket.MSG_DONTWAIT, self._target())
            return True
        except OSError:
            return False

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half the configured timeout), or None when off.

    Args:
        env: the environment to read (``os.environ`` when None).

    Returns:
        The interval, or None when systemd's watchdog is off or meant for another process.
    """
    environ: Mapping[str, str] = os.environ if env is None else env
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6
    except ValueError:
        return None
