"""On S3 too, rank 0's commit and a load's object-list reads grow at most linearly with the ranks.

``tests/ckpt_store/save/test_commit_scale.py`` counts rank 0's calls on a local disk (no A x W
term, at most a call per rank). This is the same count on S3 (SeaweedFS), through the code
behind ``bench/scale.py``'s ``commit`` figures (``bench/scale_commit.py``): simulated ranks
write their parts of one step with ckpt_store's own code, then rank 0's ``commit`` and the
manifest reads go through a storage that counts its calls. Between two small rank counts,
rank 0's calls and a one-process load's list reads grow at most as the ranks do, and rank 0 of
a collective load reads the same few lists whatever the ranks. Nothing is timed.
"""

from __future__ import annotations

from bench.scale_commit import commit_at

SMALL, LARGE = 8, 32


def test_rank0_commit_calls_and_list_reads_grow_linearly_on_s3(s3):
    small = commit_at(s3.url("commit-scale-s"), SMALL, s3.storage_options)
    large = commit_at(s3.url("commit-scale-l"), LARGE, s3.storage_options)
    growth = LARGE / SMALL
    assert large["rank0_storage_calls"] <= small["rank0_storage_calls"] * growth, (small, large)
    assert large["load_list_reads"] <= small["load_list_reads"] * growth, (small, large)
    assert large["load_rank0_list_reads"] == small["load_rank0_list_reads"], (small, large)
    # what grows at all is one read per rank's done marker; every other call stays the same
    others = {k: v for k, v in large["rank0_calls"].items() if k != "read_json"}
    assert others == {k: v for k, v in small["rank0_calls"].items() if k != "read_json"}, (small, large)
    assert large["rank0_calls"]["read_json"] == LARGE and small["rank0_calls"]["read_json"] == SMALL
