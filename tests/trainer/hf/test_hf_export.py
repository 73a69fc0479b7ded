"""`marind ckpt export --format hf` and `[model] init_from` on checkpoints the trainer wrote.

Real gloo ranks train a tiny model; the export is loaded by `transformers` and must give
the trainer's logits; a run started from the export saves the same arrays back; an export
of a checkpoint much bigger than its shards stays within a memory bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_store import CheckpointStore
from ckpt_store.export.sharded import INDEX_FILE, read_array
from marind.testing.procs import REPO_ROOT, base_env, run_torch_workers
from marind.trainer.config import init_from_problem, load_trainer_spec
from marind.trainer.data import corpus
from marind.trainer.hf.mapping import expected_shapes
from marind.trainer.model.gpt import GPT, ModelConfig

transformers = pytest.importorskip("transformers")

SEQ = 32


def _spec_text(data: str, ckpt: str, *, steps: int = 4, tie: bool = True, dp_shard: int = -1, tp: int = 1,
               init_from: str = "", ac: bool = False) -> str:
    return f"""
[job]
name = "hf-test"
[model]
preset = "tiny"
tie_embeddings = {str(tie).lower()}
rope_theta = 5000.0
norm_eps = 1e-6
init_from = "{init_from}"
[parallel]
dp_shard = {dp_shard}
tp = {tp}
activation_checkpointing = {str(ac).lower()}
[data]
path = "{data}"
seq_len = {SEQ}
global_batch = 4
micro_batch = 1
[optim]
lr = 3e-3
warmup_steps = 1
[train]
steps = {steps}
seed = 11
[checkpoint]
url = "file://{ckpt}"
every_steps = 100
keep_last = 0
"""


def _spec(*args, **kwargs) -> dict:
    return load_trainer_spec(_spec_text(*args, **kwargs), check_worlds=False).to_dict()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    corpus.write_example_dataset(prefix, 40)
    return str(prefix)


@pytest.fixture(scope="module", params=["tied", pytest.param("untied", marks=pytest.mark.slow)])
def trained(request, data, tmp_path_factory):
    """(checkpoint dir, step) of a tiny model trained a few steps (tied: 2 FSDP ranks; untied: 1 rank)."""
    tie = request.param == "tied"
    ckpt = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    res = run_torch_workers("tests.trainer.workers:train_and_digest", 2 if tie else 1, timeout=300,
                            spec=_spec(data, str(ckpt), tie=tie))
    assert res[0]["last_checkpoint_step"] == 4
    return ckpt, 4


def _marind(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "marind", "ckpt", *args], cwd=REPO_ROOT, env=base_env(),
                          capture_output=True, text=True, timeout=300)


def _trainer_model(store: CheckpointStore, step: int) -> GPT:
    cfg = store.load({}, step)["extra"]["model_config"]
    model = GPT(ModelConfig(**cfg))
    sd = model.state_dict()
    store.load_arrays({"model": sd}, step)
    return model.eval()


def test_export_loads_in_transformers_with_the_trainers_logits(trained, tmp_path):
    ckpt, step = trained
    out = tmp_path / "hf"
    res = _marind("export", f"file://{ckpt}", "--step", str(step), "--format", "hf", str(out),
                  "--max-shard-size", "60KB")
    assert res.returncode == 0, res.stderr
    assert "export:" in res.stderr     # progress lines (stderr is not a TTY)
    index = json.loads((out / INDEX_FILE).read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(set(index["weight_map"].values()))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "model.layers.1.self_attn.q_proj.weight" in index["weight_map"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["rms_norm_eps"] == 1e-6

    store = CheckpointStore(f"file://{ckpt}")
    ours = _trainer_model(store, step)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert theirs.config.tie_word_embeddings == ours.cfg.tie_embeddings
    tokens = torch.randint(0, ours.cfg.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ours(tokens)
        got = theirs(input_ids=tokens).logits
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= 1e-5, f"max abs logit difference {diff}"
    assert want.abs().max().item() > 0.1     # a real comparison, not two zero tensors

    half = tmp_path / "hf-bf16"     # --dtype bfloat16: every weight cast as written, config says so
    res = _marind("export", f"file://{ckpt}", "--step", str(step), "--format", "hf", str(half), "--dtype", "bfloat16")
    assert res.returncode == 0, res.stderr
    assert json.loads((half / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert json.loads((half / INDEX_FILE).read_text())["metadata"]["total_size"] * 2 == index["metadata"]["total_size"]
    low = transformers.AutoModelForCausalLM.from_pretrained(str(half)).eval()
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    for name, t in low.state_dict().items():
        assert torch.equal(t, theirs.state_dict()[name].to(torch.bfloat16)), name
    res = _marind("export", f"file://{ckpt}", "--step", str(step), str(tmp_path / "st"), "--dtype", "float16")
    assert res.returncode == 2 and "--format hf only" in res.stderr and not (tmp_path / "st").exists()


def test_export_then_init_from_saves_the_same_arrays(trained, data, tmp_path):
    ckpt, step = trained
    tied = CheckpointStore(f"file://{ckpt}").load({}, step)["extra"]["model_config"]["tie_embeddings"]
    out = tmp_path / "hf"
    res = _marind("export", f"file://{ckpt}", "--step", str(step), "--format", "hf", str(out))
    assert res.returncode == 0, res.stderr
    spec_text = _spec_text(data, str(tmp_path / "again"), tie=tied, dp_shard=1, tp=2, init_from=str(out), ac=True)
    assert init_from_problem(load_trainer_spec(spec_text, check_worlds=False)) is None
    run_torch_workers("tests.trainer.workers:init_and_save", 2, timeout=300,
                      spec=load_trainer_spec(spec_text, check_worlds=False).to_dict())
    before, after = CheckpointStore(f"file://{ckpt}"), CheckpointStore(f"file://{tmp_path}/again")
    m0, m1 = before.manifest(step), after.manifest(0)
    names = sorted(n for n in m0["arrays"] if n.startswith("model/"))
    assert names == sorted(n for n in m1["arrays"] if n.startswith("model/"))
    differ = [n for n in names if not torch.equal(read_array(before, step, n, m0["arrays"][n]),
                                                  read_array(after, 0, n, m1["arrays"][n]))]
    assert not differ


@pytest.mark.slow       # make chaos (CI time): CI keeps export -> init_from and the refusals
def test_a_run_with_a_checkpoint_resumes_it_not_init_from(trained, data, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt, step = trained
    tie = CheckpointStore(f"file://{ckpt}").load({}, step)["extra"]["model_config"]["tie_embeddings"]
    out = tmp_path / "hf"
    assert _marind("export", f"file://{ckpt}", "--step", str(step), "--format", "hf", str(out)).returncode == 0
    doubled = tmp_path / "doubled"     # one model.safetensors, no index: the other layout init_from reads
    doubled.mkdir()
    (doubled / "config.json").write_text((out / "config.json").read_text())
    weights = {}
    for f in out.glob("*.safetensors"):
        weights |= {k: 2 * v for k, v in load_file(str(f)).items()}
    save_file(weights, str(doubled / "model.safetensors"))
    again = tmp_path / "again"
    first = run_torch_workers("tests.trainer.workers:init_and_save", 1, timeout=300,
                              spec=_spec(data, str(again), tie=tie, init_from=str(doubled)))[0]
    store, orig = CheckpointStore(f"file://{again}"), CheckpointStore(f"file://{ckpt}")
    m = orig.manifest(step)
    wq = "model/layers.0.attention.wq.weight"
    assert torch.equal(read_array(store, 0, wq, m["arrays"][wq]), 2 * read_array(orig, step, wq, m["arrays"][wq]))
    second = run_torch_workers("tests.trainer.workers:init_and_save", 1, timeout=300,
                               spec=_spec(data, str(again), tie=tie, init_from=str(out)))[0]
    assert second["digests"] == first["digests"]     # restored step 0, not the undoubled init_from


def test_init_from_that_does_not_fit_is_refused_at_submit(trained, data, tmp_path):
    ckpt, step = trained
    out = tmp_path / "hf"
    assert _marind("export", f"file://{ckpt}", "--step", str(step), "--format", "hf", str(out)).returncode == 0
    wrong = _spec_text(data, str(tmp_path / "c"), init_from=str(out)).replace('preset = "tiny"', 'preset = "small"')
    problem = init_from_problem(load_trainer_spec(wrong, check_worlds=False))
    assert problem and "model.dim" in problem and "\n" not in problem
    missing = _spec_text(data, str(tmp_path / "c"), init_from=str(tmp_path / "nope"))
    assert "is not a directory" in (init_from_problem(load_trainer_spec(missing, check_worlds=False)) or "")


def _tiny_checkpoint(url: str, *, with_config: bool) -> dict:
    cfg = {"vocab_size": 64, "dim": 16, "n_layers": 1, "n_heads": 2, "ffn_dim": 32, "seq_len": 8,
           "tie_embeddings": True, "norm_eps": 1e-5, "rope_theta": 10000.0}
    state: dict = {"model": {n: torch.randn(s) for n, s in expected_shapes(cfg).items()}, "extra": {"step": 1}}
    if with_config:
        state["extra"]["model_config"] = cfg
    CheckpointStore(url, writer="thread").save(1, state, async_=False)
    return cfg


def test_export_errors_are_one_line_and_write_nothing(tmp_path, data):
    url = f"file://{tmp_path}/old"
    _tiny_checkpoint(url, with_config=False)
    out = tmp_path / "hf"
    res = _marind("export", url, "--step", "1", "--format", "hf", str(out))
    assert res.returncode == 2 and "--config run.toml" in res.stderr and not out.exists()
    assert len(res.stderr.strip().splitlines()) == 1
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(_spec_text(data, str(tmp_path / "x")).replace(
        'preset = "tiny"', 'preset = "custom"\ndim = 16\nn_layers = 1\nn_heads = 2\nffn_dim = 32'))
    res = _marind("export", url, "--step", "1", "--format", "hf", str(out), "--config", str(run_toml))
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 64
    res = _marind("export", url, "--step", "1", "--format", "hf", str(out), "--config", str(run_toml))
    assert res.returncode == 2 and "not an empty directory" in res.stderr
    res = _marind("export", url, "--step", "1", "--format", "hf", str(tmp_path / "y"), "--max-shard-size", "lots")
    assert res.returncode == 2 and "--max-shard-size" in res.stderr and not (tmp_path / "y").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]



def _word_tokenizer(path: Path, words: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_export_carries_the_data_s_tokenizer(tmp_path):
    url = f"file://{tmp_path}/ck"
    _tiny_checkpoint(url, with_config=True)                       # vocabulary 64
    small = _word_tokenizer(tmp_path / "small.json", ["marin", "trains", "models"])
    out = tmp_path / "hf"
    res = _marind("export", url, "--step", "1", "--format", "hf", str(out), "--tokenizer", str(small))
    assert res.returncode == 0, res.stderr
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok("marin trains models")["input_ids"] == [1, 2, 3]
    big = _word_tokenizer(tmp_path / "big.json", [f"w{i}" for i in range(100)])
    for bad, words in ((big, "101 tokens"), (tmp_path / "none.json", "not a readable")):
        res = _marind("export", url, "--step", "1", "--format", "hf", str(tmp_path / "x"), "--tokenizer", str(bad))
        assert res.returncode == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


_MEASURE = """
import json, re, sys
import psutil
from marind.cli import main
import ckpt_store.export.sharded, marind.trainer.hf.export, safetensors  # imports before the baseline
base = psutil.Process().memory_info().rss
rc = main(["ckpt", "export", sys.argv[1], "--step", "1", "--format", "hf", sys.argv[2],
           "--max-shard-size", sys.argv[3]])
hwm = re.search(r"VmHWM:\\s*(\\d+) kB", open("/proc/self/status").read())
print(json.dumps({"rc": rc, "base": base, "peak": int(hwm.group(1)) * 1024}))
"""
# VmHWM, not getrusage: ru_maxrss survives exec, so a child would report this test's own peak


def test_export_memory_is_bounded_by_the_shard_size(tmp_path):
    cfg = {"vocab_size": 4096, "dim": 1024, "n_layers": 6, "n_heads": 8, "ffn_dim": 2816, "seq_len": 64,
           "tie_embeddings": False, "norm_eps": 1e-5, "rope_theta": 10000.0}
    shapes = expected_shapes(cfg)
    total = sum(4 * torch.Size(s).numel() for s in shapes.values())
    shard = 32 * 10**6
    largest = max(4 * torch.Size(s).numel() for s in shapes.values())
    bound = 2 * shard + 64 * 2**20     # a shard being written, one array in flight, and slack
    assert largest < shard and total > 2 * bound     # an exporter holding the checkpoint would fail
    url = f"file://{tmp_path}/big"
    gen = torch.Generator().manual_seed(0)
    state = {"model": {n: torch.randn(s, generator=gen) for n, s in shapes.items()},
             "extra": {"step": 1, "model_config": cfg}}
    CheckpointStore(url, writer="thread").save(1, state, async_=False)
    del state
    res = subprocess.run([sys.executable, "-c", _MEASURE, url, str(tmp_path / "hf"), str(shard)], cwd=REPO_ROOT,
                         env=base_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0
    index = json.loads(Path(tmp_path / "hf" / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == total and len(set(index["weight_map"].values())) > 5
    grew = got["peak"] - got["base"]
    assert grew < bound, f"export RSS grew {grew / 2**20:.0f} MiB for {total / 2**20:.0f} MiB of arrays " \
                         f"(bound {bound / 2**20:.0f} MiB)"


def test_submit_refuses_an_init_from_that_is_missing(data, tmp_path, capsys, monkeypatch):
    from marind.cli import main
    from marind.core.netutil import free_port

    monkeypatch.setenv("MARIND_ETCD", f"http://127.0.0.1:{free_port()}")   # nothing may reach it (exit 3)
    monkeypatch.delenv("MARIND_DEBUG", raising=False)
    path = tmp_path / "run.toml"
    path.write_text(_spec_text(data, str(tmp_path / "c"), init_from="models/none"))
    assert main(["submit", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"model.init_from: {tmp_path}/models/none is not a directory" in err, err
    (tmp_path / "models" / "none").mkdir(parents=True)
    assert main(["submit", str(path)]) == 2
    assert "has no model.safetensors" in capsys.readouterr().err
    path.write_text(_spec_text(data, str(tmp_path / "c")))
    assert main(["submit", str(path)]) == 3          # valid without init_from: it got as far as etcd
