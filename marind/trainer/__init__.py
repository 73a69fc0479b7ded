"""The reference GPT trainer: ``python -m marind.trainer run.toml``.

It uses marind's public APIs only (``marind.worker``, ``ckpt_store``), never the agent, the
rendezvous or the CLI, so it is also the example of a program of your own under marind.

* ``main``: the entry point; ``train``: the elastic mode (one torch world, resized by
  torchrun restarts); ``loop``: the one training loop both modes share;
* ``build``: everything a run holds before its first step; ``config``: its sections of
  run.toml, presets and batch arithmetic; ``schedule``: the learning rate and MFU;
* ``checkpointing``: the trainer's state, saved and restored through ``ckpt_store``;
  ``peak_memory``: this rank's peak memory for the final record.

Packages, each with its module map:

* ``model/``: the GPT, mixture-of-experts blocks and their spec, layout-free initial weights;
* ``parallel/``: the device mesh (FSDP2, TP), expert parallelism, the pipeline, the global
  gradient norm;
* ``ft/``: torchft mode, one replica group per torch world;
* ``hf/``: Hugging Face interop (export, parameter mapping, ``[model] init_from``);
* ``data/``: token datasets and the sampler, the example corpus, tokenizers.
"""

# What marind's zygote imports before it forks warm workers (marind/agent/warm_start/zygote.py): the trainer, and
# what torch imports lazily on a worker's first fully_shard/step (torch._dynamo alone is seconds of CPU:
# docs/perf.md, "Daemon and warm starts").
MARIND_PRELOAD = ("marind.trainer.main", "marind.trainer.train", "torch._dynamo", "torch._functorch", "torch.profiler",
                  "statistics")
#: and in torchft mode: its loop and torchft (a restarted group's workers would import them cold)
MARIND_PRELOAD_TORCHFT = ("marind.trainer.ft.train", "torchft")
