"""Pure parts of torchft mode: the [fault] spec, the data slices of replica groups, the torchrun command."""

from __future__ import annotations

from pathlib import Path

import pytest

from marind.agent.supervisor import torchrun_command
from marind.errors import SpecError
from marind.spec import load_spec

BASE = """
[job]
nodes = "1:{nodes}"
nproc_per_node = 2
[data]
path = "d"
global_batch = 8
micro_batch = 2
[fault]
mode = "torchft"
replica_groups = {groups}
min_replicas = {min}
"""


def spec(nodes=2, groups=2, min=1, extra=""):
    return load_spec(BASE.format(nodes=nodes, groups=groups, min=min) + extra)


def test_torchft_world_is_one_group():
    s = spec(nodes=3, groups=3)
    assert s.fault.mode == "torchft" and s.world_sizes() == [2]
    assert s.to_dict()["fault"]["replica_groups"] == 3
    assert type(s).from_dict(s.to_dict()) == s


@pytest.mark.parametrize("kw, extra, match", [
    ({}, 'timeout = "0s"\n', "fault.timeout"),
    ({"min": 3}, "", "fault.min_replicas = 3 exceeds"),
    ({"nodes": 3}, "", "at most fault.replica_groups = 2 nodes"),
    ({}, "bogus = 1\n", "unknown key 'fault.bogus'"),
])
def test_fault_errors_name_the_key(kw, extra, match):
    with pytest.raises(SpecError, match=match):
        spec(**kw, extra=extra)


def test_mode_typo_did_you_mean():
    with pytest.raises(SpecError, match="did you mean 'torchft'"):
        load_spec(BASE.format(nodes=1, groups=2, min=1).replace('"torchft"', '"torchf"'))


def test_elastic_default_unchanged():
    s = load_spec(BASE.format(nodes=2, groups=2, min=1).replace('mode = "torchft"', ""))
    assert s.fault.mode == "elastic" and s.world_sizes() == [2, 4]


def test_group_slices_are_disjoint_and_cover_each_step():
    pytest.importorskip("torch")      # trainer.ft imports torch
    from trainer.ft import sample_indices
    s = spec(groups=3, nodes=3)           # global_batch 8 per group, micro 2, 2 ranks -> accum 2
    for step in (0, 1, 7):
        seen = []
        for group in range(3):
            for dp_rank in range(2):
                for micro in range(2):
                    seen += list(sample_indices(step, micro_step=micro, spec=s, group=group, groups=3,
                                                dp_rank=dp_rank, dp_size=2))
        assert sorted(seen) == list(range(step * 24, (step + 1) * 24))


def test_torchrun_is_a_one_node_rendezvous_per_group_under_the_job():
    s = spec().to_dict()
    cmd = torchrun_command(python="py", job="j", spec=s, endpoint="http://e:2379", prefix="/m",
                           run_toml=Path("run.toml"), node="n1")
    assert "--standalone" not in cmd and "--nnodes=1" in cmd
    assert "--rdzv-backend=etcd3" in cmd and "--rdzv-id=rg-n1" in cmd and "--rdzv-endpoint=e:2379" in cmd
    assert any(c.startswith("--rdzv-conf=prefix=/m/jobs/j/ft") for c in cmd)
