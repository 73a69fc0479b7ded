"""Why a rank failed, from its own error text, exit and OOM evidence: pure classification on real texts."""

from __future__ import annotations

import signal

import pytest

from marind.control.failure_causes import (
    CAUSES,
    OomEvidence,
    cause_of,
    cuda_figures,
    error_kind,
    human_bytes,
    keep_first,
    nonfinite_cause,
    peer_of,
)

pytestmark = pytest.mark.unit

# printed by real torch 2.13 (CPU, gloo) runs on this machine
GLOO_TIMEOUT = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 5000ms for recv operation to complete")
GLOO_PEER = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
             "by peer [127.0.0.1]:22938. This is typically caused by a remote worker crashing. Check the logs of the "
             "remote worker before reporting an error. GLHF!")
EMBEDDING = "IndexError: index out of range in self"          # F.embedding with a token id past the table
MISSING = "FileNotFoundError: [Errno 2] No such file or directory: 'data/example.idx'"
# raised by marind's own trainer (marind/trainer/build.py, marind/trainer/train.py)
VOCAB = ("ValueError: model.vocab_size = 256 is smaller than the data's vocabulary (50257); raise it or "
         "remove it")
DIVERGED = ("marind.trainer.train.TrainingDiverged: 3 non-finite steps in a row at step 40 and no checkpoint to "
            "roll back to; lower optim.lr or enable [checkpoint]")
# torch's CUDA caching allocator and NCCL watchdog messages, in the form torch 2.x prints them (no GPU here)
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.41 GiB is free. Including non-PyTorch memory, this process has 77.77 GiB memory in "
            "use. Of the allocated memory 75.12 GiB is allocated by PyTorch, and 1.15 GiB is reserved by PyTorch but "
            "unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
NCCL_TIMEOUT = ("torch.distributed.DistBackendError: [Rank 0] Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran "
                "for 600031 milliseconds before timing out.")
NCCL_REMOTE = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:2046, remote process exited "
               "or there was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a "
               "network error or a remote process exiting prematurely.")


@pytest.mark.parametrize(("text", "kind"), [
    (GLOO_TIMEOUT, "collective_timeout"), (NCCL_TIMEOUT, "collective_timeout"), (GLOO_PEER, "peer_lost"),
    (NCCL_REMOTE, "peer_lost"), (CUDA_OOM, "cuda_oom"), (EMBEDDING, "tokenizer_mismatch"),
    (VOCAB, "tokenizer_mismatch"), (MISSING, "data_missing"), (DIVERGED, "nonfinite_loss"),
    ("ValueError: bad learning rate schedule", "error"), ("KeyboardInterrupt", "error"),
])
def test_error_kinds(text, kind):
    assert error_kind(text) == kind


def test_cuda_oom_names_the_figures_and_the_knobs():
    assert cuda_figures(CUDA_OOM) == {"GPU": "0", "tried to allocate": "2.00 GiB", "GPU total": "79.19 GiB",
                                      "free": "1.41 GiB", "in use by the process": "77.77 GiB",
                                      "allocated by PyTorch": "75.12 GiB", "reserved but unallocated": "1.15 GiB"}
    c = cause_of(node="gpu-3", exitcode=1, rank=5, local_rank=1, error=CUDA_OOM)
    assert c.kind == "cuda_oom" and c.what.startswith("rank 5 (local 1) on gpu-3: CUDA out of memory (GPU 0, ")
    assert "tried to allocate 2.00 GiB" in c.what and "allocated by PyTorch 75.12 GiB" in c.what
    assert all(knob in c.fix for knob in ("micro-batch", "activation checkpointing", "shard wider"))


def test_a_sigkill_with_oom_evidence_is_the_oom_killer_else_a_signal():
    ev = OomEvidence("cgroup", cgroup="/jobs/x", limit_bytes=256 << 20, peak_bytes=(256 << 20) - 4096)
    c = cause_of(node="a", exitcode=-signal.SIGKILL, rank=1, local_rank=1, pid=77, oom=ev)
    assert c.kind == "oom_killed" and c.line == (
        "rank 1 (local 1) on a was killed by the kernel's OOM killer (SIGKILL, pid 77; seen in the cgroup) "
        f"(memory cgroup /jobs/x, limit 256.0 MiB, peak 256.0 MiB); fix: {CAUSES['oom_killed']}")
    plain = cause_of(node="a", exitcode=-signal.SIGKILL, rank=1, local_rank=1, pid=77)
    assert (plain.kind, plain.what) == ("killed", "rank 1 (local 1) on a was killed by SIGKILL (pid 77)")
    # OOM evidence does not explain an exit that was no SIGKILL
    assert cause_of(node="a", exitcode=-signal.SIGTERM, rank=1, local_rank=1, oom=ev).kind == "killed"
    assert cause_of(node="a", exitcode=3, local_rank=0).what == "local rank 0 on a ended with exit code 3"


def test_a_timeout_names_who_stopped_answering_and_a_peer_gone_is_an_echo():
    c = cause_of(node="a", exitcode=1, rank=0, local_rank=0, error=GLOO_TIMEOUT, silent_ranks=[1])
    assert c.kind == "collective_timeout" and "rank 1 stopped answering" in c.what and not c.echo
    c = cause_of(node="a", exitcode=1, rank=0, local_rank=0, error=GLOO_TIMEOUT, silent_ranks=[])
    assert "a rank on another node stopped answering" in c.what
    c = cause_of(node="a", exitcode=1, rank=0, local_rank=0, error=GLOO_PEER)
    assert c.kind == "peer_lost" and c.echo and "its peer at 127.0.0.1 went away" in c.what
    assert peer_of(GLOO_PEER) == "127.0.0.1" and peer_of(NCCL_REMOTE) is None


def test_an_echo_does_not_replace_a_cause_recorded_just_before():
    cause = {"line": "rank 1 ... OOM", "at": 100.0, "echo": False}
    echo = {"line": "rank 0 ... peer", "at": 101.0, "echo": True}
    assert not keep_first(cause, echo)                      # the OOM stays the job's reason
    assert keep_first(cause, {**echo, "at": 400.0})         # a later failure of its own
    assert keep_first(None, echo) and keep_first(echo, cause) and keep_first(cause, {**cause, "at": 102.0})


def test_nonfinite_and_sizes():
    c = nonfinite_cause(12, "nan", "a")
    assert c.kind == "nonfinite_loss" and c.what == "the loss became nan at step 12 (rank 0 on a)"
    assert [human_bytes(n) for n in (None, 512, 3 << 20, 5 << 30)] == ["?", "512 B", "3.0 MiB", "5.0 GiB"]
