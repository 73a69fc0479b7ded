"""Tokenizers for ``marind data prepare``: bytes by default, or a local HF ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256)."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))


class HFTokenizer:
    """A Hugging Face ``tokenizers`` file (local only; nothing is downloaded)."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ValueError("--tokenizer needs the `tokenizers` package: pip install tokenizers, "
                             "or omit --tokenizer for the byte-level default") from exc
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``."""
        return self._tok.encode(text).ids


def get_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of ``tokenizer.json`` at ``path``, or the byte tokenizer when None.

    Raises:
        ValueError: ``path`` is given but the ``tokenizers`` package is missing.
    """
    return HFTokenizer(path) if path else ByteTokenizer()
