"""The reference GPT trainer: ``python -m marind.trainer run.toml``."""

# What marind's zygote imports before it forks warm workers (marind/zygote.py): the trainer, and
# what torch imports lazily on a worker's first fully_shard/step (torch._dynamo alone is ~3 s of CPU).
MARIND_PRELOAD = ("marind.trainer.main", "marind.trainer.train", "torch._dynamo", "torch._functorch", "torch.profiler",
                  "statistics")
