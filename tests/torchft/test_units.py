"""Pure parts of torchft mode: the [fault] spec, the data slices of replica groups, the torchrun command."""

from __future__ import annotations

from pathlib import Path

import pytest

from marind.agent.torchrun_args import torchrun_command
from marind.core.errors import SpecError
from marind.core.spec import load_spec

pytestmark = pytest.mark.unit

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


def test_a_group_of_nodes_is_one_world():
    s = spec(nodes=4, groups=2, extra="nodes_per_group = 2\n")
    assert s.world_sizes() == [4] and s.fault.nodes_per_group == 2


@pytest.mark.parametrize("kw, extra, match", [
    ({}, 'timeout = "0s"\n', "fault.timeout"),
    ({"min": 3}, "", "fault.min_replicas = 3 exceeds"),
    ({"nodes": 3}, "", "at most fault.replica_groups x fault.nodes_per_group = 2 nodes"),
    ({"nodes": 5}, "nodes_per_group = 2\n", "fault.nodes_per_group = 4 nodes"),
    ({}, "nodes_per_group = 0\n", "fault.nodes_per_group must be > 0"),
    ({}, "bogus = 1\n", "unknown key 'fault.bogus'"),
    ({}, 'straggler_action = "exclude"\n', 'straggler_action = "exclude" works in elastic mode only'),
])
def test_fault_errors_name_the_key(kw, extra, match):
    with pytest.raises(SpecError, match=match):
        spec(**kw, extra=extra)


def test_mode_typo_did_you_mean():
    with pytest.raises(SpecError, match="did you mean 'torchft'"):
        load_spec(BASE.format(nodes=1, groups=2, min=1).replace('"torchft"', '"torchf"'))


def test_elastic_default_unchanged():
    s = load_spec(BASE.format(nodes=2, groups=2, min=1).replace('mode = "torchft"', ""))
    assert s.fault.mode == "elastic" and s.world_sizes() == [2, 4] and s.fault.straggler_action == "none"


def test_the_straggler_action_is_none_or_exclude():
    elastic = BASE.format(nodes=2, groups=2, min=1).replace('mode = "torchft"', "")
    assert load_spec(elastic + 'straggler_action = "exclude"\n').fault.straggler_action == "exclude"
    with pytest.raises(SpecError, match="fault.straggler_action = 'drop': use \"none\""):
        load_spec(elastic + 'straggler_action = "drop"\n')


def test_group_slices_are_disjoint_and_cover_each_step():
    pytest.importorskip("torch")      # trainer.ft imports torch
    from marind.trainer.config import trainer_spec
    from marind.trainer.ft.train import sample_indices
    s = trainer_spec(spec(groups=3, nodes=3))           # global_batch 8 per group, micro 2, 2 ranks -> accum 2
    for step in (0, 1, 7):
        seen = []
        for group in range(3):
            for dp_rank in range(2):
                for micro in range(2):
                    seen += list(sample_indices(step, micro_step=micro, spec=s, group=group, groups=3,
                                                dp_rank=dp_rank, dp_size=2))
        assert sorted(seen) == list(range(step * 24, (step + 1) * 24))


def test_torchrun_is_one_rendezvous_per_group_under_the_job():
    s = spec()
    cmd = torchrun_command(python="py", job="j", spec=s, endpoint="http://e:2379", prefix="/m",
                           run_toml=Path("run.toml"), replica_group=1)
    assert "--standalone" not in cmd and "--nnodes=1" in cmd
    assert "--rdzv-backend=etcd3" in cmd and "--rdzv-id=rg-1" in cmd and "--rdzv-endpoint=e:2379" in cmd
    assert any(c.startswith("--rdzv-conf=prefix=/m/jobs/j/ft") for c in cmd)
    two = spec(nodes=4, extra="nodes_per_group = 2\n")
    cmd = torchrun_command(python="py", job="j", spec=two, endpoint="e:1", prefix="/m", run_toml=Path("r"),
                           replica_group=0)
    assert "--nnodes=2" in cmd and "--rdzv-id=rg-0" in cmd
    with pytest.raises(ValueError, match="replica_group"):
        torchrun_command(python="py", job="j", spec=s, endpoint="e:1", prefix="/m", run_toml=Path("r"))


def test_claim_order_completes_groups_before_starting_new_ones():
    from marind.agent.ft.coordinator import claim_order
    from marind.control.ft_status import group_members
    assert claim_order({}, 2, 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    held = {1: {0: "a"}}
    assert claim_order(held, 3, 2) == [(1, 1), (0, 0), (0, 1), (2, 0), (2, 1)]
    assert claim_order(held, 3, 2, prefer=2)[0] == (2, 0)
    assert claim_order({0: {0: "a"}, 1: {0: "b"}}, 2, 1) == []
    recs = {"/p/jobs/j/ft/groups/1/0": {"node": "a"}, "/p/jobs/j/ft/groups/1/1": {"node": "b"},
            "/p/jobs/j/ft/groups/0": {"node": "old-layout"}, "/p/jobs/j/ft/groups/2/0": "junk"}
    assert group_members(recs) == {1: {0: "a", 1: "b"}}


def test_the_zygote_preloads_torchft_for_a_torchft_job_only(tmp_path):
    from marind.trainer import MARIND_PRELOAD, MARIND_PRELOAD_TORCHFT
    from marind.trainer.config import trainer_spec
    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(b"")
    text = BASE.format(nodes=2, groups=2, min=1).replace('path = "d"', f'path = "{tmp_path}/d"')
    ft = trainer_spec(load_spec(text), check_worlds=False)
    assert ft.job.preload == (*MARIND_PRELOAD, *MARIND_PRELOAD_TORCHFT)
    elastic = trainer_spec(load_spec(text.replace('mode = "torchft"', "")), check_worlds=False)
    assert elastic.job.preload == MARIND_PRELOAD
    own = trainer_spec(load_spec(text.replace("[data]", 'preload = ["a.b"]\n[data]')), check_worlds=False)
    assert own.job.preload == ("a.b",)             # the job's own list is the job's


def test_a_failed_quorum_waits_for_a_new_lighthouse_only_while_the_old_one_is_silent():
    from marind.trainer.ft.group import LIGHTHOUSE_WAIT_S, REBUILD_PAUSE_S, rebuild_wait
    assert rebuild_wait(built_epoch=3, epoch=4, answers=lambda: False, waited_s=0.0)[0] is False     # moved
    assert rebuild_wait(built_epoch=3, epoch=3, answers=lambda: False, waited_s=5.0)[0] is True      # silent: its host may be gone
    assert rebuild_wait(built_epoch=3, epoch=3, answers=lambda: True, waited_s=0.2)[0] is True       # the pause
    asked = []
    rebuild_wait(built_epoch=3, epoch=3, answers=lambda: asked.append(1) or True, waited_s=0.2)
    assert not asked                                    # no status read during the pause
    wait, why = rebuild_wait(built_epoch=3, epoch=3, answers=lambda: True, waited_s=REBUILD_PAUSE_S)
    assert not wait and "answers" in why                                                      # alive: nothing to wait for
    wait, why = rebuild_wait(built_epoch=3, epoch=3, answers=lambda: False, waited_s=LIGHTHOUSE_WAIT_S)
    assert not wait and "again" in why
