"""Retention and garbage collection decisions (pure).

* ``steps_to_delete``: keep the newest ``keep_last`` committed steps, every
  step divisible by ``keep_every`` (permanent), ALWAYS the newest one, and
  the ones in ``keep`` (the step a save just committed: a run that resumed
  from an older step saves below the newest, and must not lose its own
  latest checkpoint to the abandoned newer ones).
* ``leftovers_to_delete``: uncommitted step directories older than the newest
  commit (a save in flight is always newer than the newest commit).
"""

from __future__ import annotations


def steps_to_delete(committed: list[int], keep_last: int | None, keep_every: int | None,
                    keep: set[int] | frozenset = frozenset()) -> list[int]:
    if not committed or keep_last is None:
        return []
    ordered = sorted(committed)
    keep = set(keep) | set(ordered[-max(1, keep_last):])
    keep.add(ordered[-1])
    if keep_every:
        keep.update(s for s in ordered if s % keep_every == 0)
    return [s for s in ordered if s not in keep]


def leftovers_to_delete(all_dirs: list[int], committed: list[int],
                        in_flight: set[int] | frozenset = frozenset()) -> list[int]:
    if not committed:
        return []
    newest = max(committed)
    done = set(committed)
    return sorted(s for s in all_dirs if s < newest and s not in done and s not in in_flight)
