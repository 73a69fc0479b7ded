"""The reference GPT trainer: ``python -m trainer run.toml``."""

# what marind's zygote imports before it forks warm workers (marind/zygote.py)
MARIND_PRELOAD = ("trainer.main", "trainer.train")
