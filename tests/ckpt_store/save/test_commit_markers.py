"""Rank 0 reads the done markers a poll lists together, in the storage's I/O threads (issue 31).

Every rank's part of step 1 is written (``test_commit_scale._write_parts``: real parts on a
real local filesystem), then rank 0's ``commit`` runs on a counting ``LocalStorage`` whose
marker reads can be held or made to fail. The markers' reads are in flight together (they
meet in pairs at a barrier of two, which reads one after another never reach); a read that
fails in the batch is read again at the next poll while the others are kept, so every
other marker is read once; an error marker fails the commit at once, before any done
marker is read, and rank 0 then writes the abort marker. Nothing is timed.
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import pytest

from ckpt_store.errors import CheckpointSaveFailed
from ckpt_store.format.manifest import FORMAT
from ckpt_store.save.commit import commit, marker_key, write_error_marker
from tests.ckpt_store.save.test_commit_scale import CountingStorage, _layout, _write_parts

D = "step-0000000001"
WORLD = 4


class MarkerStorage(CountingStorage):
    """``CountingStorage`` (2 I/O threads) that counts reads per key and can hold each done
    marker's read at a barrier of as many parties as I/O threads (``hold``: W = 4 reads meet in
    pairs) or fail the first read of ``fail_once``."""

    def __init__(self, root: str, hold: bool = False, fail_once: frozenset[str] = frozenset()):
        super().__init__(root)
        self.by_key: Counter = Counter()
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(self.io_threads, timeout=20) if hold else None
        self._fail = set(fail_once)

    def read(self, key):
        with self._lock:
            self.by_key[key] += 1
            fail = key in self._fail
            self._fail.discard(key)
        if "/.marind/rank-" in key and self._barrier is not None:
            self._barrier.wait()       # broken (an error) unless the markers' reads are in flight together
        if fail:
            raise OSError(f"injected read failure of {key}")
        return super().read(key)


def _commit(tmp_path, **storage) -> tuple[MarkerStorage, dict]:
    root = str(tmp_path / "ckpt")
    specs = _write_parts(root, 3, WORLD)
    st = MarkerStorage(root, **storage)
    try:
        manifest = commit(st, D, 1, WORLD, specs, {s.name: _layout(WORLD) for s in specs},
                          {"world_size": WORLD, "saved_at": "2026-01-01T00:00:00Z"}, timeout_s=30, fmt=FORMAT)
    finally:
        st.close()
    return st, manifest


def _marker_reads(st: MarkerStorage) -> dict[int, int]:
    return {r: st.by_key[marker_key(D, "rank", r)] for r in range(WORLD)}


def test_the_markers_are_read_together_each_once(tmp_path):
    st, manifest = _commit(tmp_path, hold=True)
    assert _marker_reads(st) == dict.fromkeys(range(WORLD), 1)
    assert st.calls["list_dir"] == 2          # one poll, then the check before the manifest
    assert [p["key"] for p in manifest["parts"]] == [f"parts/rank-{r:05d}.json" for r in range(WORLD)]


def test_a_marker_read_that_fails_in_the_batch_is_read_again_and_the_others_are_kept(tmp_path):
    st, manifest = _commit(tmp_path, fail_once=frozenset({marker_key(D, "rank", 2)}))
    assert _marker_reads(st) == {0: 1, 1: 1, 2: 2, 3: 1}
    assert st.calls["list_dir"] == 3          # the failed poll, the one that read rank 2's again, the check
    assert len(manifest["parts"]) == WORLD


def test_an_error_marker_fails_the_commit_at_once_and_rank_0_aborts(tmp_path):
    root = str(tmp_path / "ckpt")
    specs = _write_parts(root, 3, WORLD)
    os.remove(f"{root}/{marker_key(D, 'rank', 1)}")     # rank 1 failed: its error marker, no done marker
    st = MarkerStorage(root)
    write_error_marker(st, D, 1, "disk full")
    with pytest.raises(CheckpointSaveFailed, match="rank 1 failed to write its part: disk full"):
        commit(st, D, 1, WORLD, specs, {s.name: _layout(WORLD) for s in specs},
               {"world_size": WORLD, "saved_at": "2026-01-01T00:00:00Z"}, timeout_s=30, fmt=FORMAT)
    st.close()
    assert st.calls["list_dir"] == 1
    assert _marker_reads(st) == dict.fromkeys(range(WORLD), 0)     # no done marker read
    assert st.read_json(f"{D}/.marind/abort.json")["error"].startswith("rank 1 failed")
