"""The data probe's handshake: telling a peer agent's probe listener from anything else that answers.

A TCP connect alone proves little: a firewall's REJECT rule, a host with the
port closed, or another program on the port all answer. So the listener
(``DataProber``) writes one line on every connection it accepts,

    MARIND-DATA-PROBE/1 {token}\\n

where ``token`` is the listener's own (made at its start, published with its
endpoint in its row of the job, docs/design.md §2), and closes it. The prober
connects and reads that line within one deadline (``CONNECT_TIMEOUT_S``); the
peer counts as **reached** only when the line names the token it expects
(``verdict``). A refused connect, a reset, a timeout, nothing written, another
program's bytes or another listener's token (an agent restarted on the same
port, before its new record is read) all count as not reached.

``verdict`` is pure; ``probe_peer`` does the I/O.
"""

from __future__ import annotations

import secrets
import socket
import time

#: the greeting's first word: protocol and version
MAGIC = b"MARIND-DATA-PROBE/1"
#: the longest greeting read (a longer answer is not a probe listener's)
MAX_GREETING = 128

OK = "ok"
#: outcomes of a connection that was accepted but did not prove a probe listener
NO_GREETING = "no_greeting"        # closed, or silent until the deadline, without a line
NOT_A_PROBE = "not_a_probe"        # something else answered on the port
WRONG_TOKEN = "wrong_token"        # another probe listener (another incarnation) answered


def new_token() -> str:
    """A fresh listener token (random, 16 hex digits)."""
    return secrets.token_hex(8)


def greeting(token: str) -> bytes:
    """The line a listener with ``token`` writes on each accepted connection."""
    return MAGIC + b" " + token.encode("ascii") + b"\n"


def verdict(received: bytes, expected: str | None) -> str:
    """What the bytes a peer wrote before closing (or before the deadline) prove.

    Args:
        received: everything read from the connection, at most ``MAX_GREETING`` bytes.
        expected: the token the peer publishes; None when its row has none (then any
            probe listener's greeting counts).

    Returns:
        ``"ok"`` (reached), or why not: ``no_greeting``, ``not_a_probe``, ``wrong_token``.
    """
    if not received:
        return NO_GREETING
    head = MAGIC + b" "
    if not received.startswith(head):
        return NO_GREETING if head.startswith(received) else NOT_A_PROBE   # cut short, or another program
    line, newline, _ = received.partition(b"\n")
    if not newline:
        return NO_GREETING
    token = line[len(head):]
    if not token or b" " in token:
        return NOT_A_PROBE
    if expected is not None and token != expected.encode("ascii", "replace"):
        return WRONG_TOKEN
    return OK


def reached(outcome: str) -> bool:
    """Did a probe with this outcome reach the peer's probe listener (only ``"ok"`` does)?"""
    return outcome == OK


def probe_peer(addr: str, port: int, token: str | None, timeout: float) -> str:
    """Connect to a peer's probe listener and read its greeting, all within ``timeout`` seconds.

    Args:
        addr: the peer's data address.
        port: its probe port.
        token: the token it publishes (None: any probe listener's greeting).
        timeout: the deadline for the connect and the greeting together.

    Returns:
        ``verdict``'s outcome for what was read, or the connect's failure: ``timeout``,
        ``refused``, ``reset``, or the OS error's name and text.
    """
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((addr, port), timeout=timeout) as sock:
            received = b""
            while len(received) < MAX_GREETING and b"\n" not in received:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sock.settimeout(left)
                try:
                    chunk = sock.recv(MAX_GREETING - len(received))
                except TimeoutError:
                    break
                if not chunk:
                    break
                received += chunk
            return verdict(received, token)
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except ConnectionResetError:
        return "reset"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"


def send_greeting(conn: socket.socket, token: str, timeout: float = 1.0) -> None:
    """Write the greeting on an accepted connection and close it (errors ignored: the prober judges)."""
    try:
        conn.settimeout(timeout)
        conn.sendall(greeting(token))
    except OSError:
        pass
    finally:
        conn.close()
