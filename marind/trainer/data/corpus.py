"""A deterministic example corpus (no downloads): seeded sentences from a tiny grammar.

The text has real structure (words, agreement, punctuation, recurring
phrases) so a byte-level model's loss falls quickly, and it is the same on
every machine for a given seed.
"""

from __future__ import annotations

import random

_SUBJECTS = ["the old sailor", "a quiet miller", "the young queen", "my brother", "the keeper of the gate",
             "a wandering poet", "the baker's daughter", "the captain", "an honest clerk", "the river god"]
_VERBS = ["watched", "remembered", "carried", "followed", "praised", "feared", "painted", "answered",
          "forgot", "guarded"]
_OBJECTS = ["the grey harbour", "a lantern of brass", "the northern road", "her father's letters",
            "the silver bell", "a field of barley", "the king's horses", "the winter stars",
            "an empty boat", "the long table"]
_PLACES = ["at dawn", "in the market", "beyond the hills", "under the bridge", "before the storm",
           "by the fire", "across the sea", "in the garden", "after the feast", "near the mill"]
_LINKS = ["and then", "but", "so", "while", "because"]


def sentence(rng: random.Random) -> str:
    """One random sentence of the example corpus."""
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}"
    if rng.random() < 0.4:
        s += f", {rng.choice(_LINKS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"])


def documents(n_docs: int = 600, seed: int = 0):
    """Yield ``n_docs`` paragraphs (about 500 bytes each)."""
    rng = random.Random(seed)
    for _ in range(n_docs):
        yield " ".join(sentence(rng) for _ in range(rng.randint(4, 9))) + "\n\n"


def write_example_dataset(prefix, n_docs: int = 600, seed: int = 0):
    """Byte-tokenize ``documents(n_docs, seed)`` into ``prefix.bin`` + ``prefix.idx``; returns the header."""
    from marind.trainer.data.dataset import write_dataset
    from marind.trainer.data.tokenize import ByteTokenizer

    tok = ByteTokenizer()
    return write_dataset(prefix, (tok.encode(t) for t in documents(n_docs, seed)), tok.vocab_size)
