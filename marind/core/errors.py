"""Typed errors at marind's seams; the CLI maps them to exit codes in one place."""

from __future__ import annotations


class MarindError(Exception):
    """Base of every error marind reports to a user."""

    exit_code = 1


class SpecError(MarindError, ValueError):
    """A run spec or config file is malformed (names the key and the fix)."""

    exit_code = 2


class UsageError(MarindError):
    exit_code = 2


class ControlPlaneUnavailable(MarindError):
    """etcd cannot be reached."""

    exit_code = 3


class ControlPlaneRefused(ControlPlaneUnavailable):
    """etcd answered and refused the request for what it is (too large, its space quota reached, a
    revision compacted away, malformed): no retry and no other member changes that
    (``marind.core.etcd_errors``)."""

    exit_code = 3


class PermissionDenied(ControlPlaneUnavailable):
    """etcd refused the request: the user's roles do not allow it (docs/design.md §2, etcd roles)."""

    exit_code = 5


class JobFailed(MarindError):
    exit_code = 4


class NotFound(MarindError):
    exit_code = 1
