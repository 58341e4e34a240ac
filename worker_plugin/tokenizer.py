"""A byte-level tokenizer for models that ship none (the built-in tiny model).

Ids 0..2 are pad/bos/eos; byte ``b`` is id ``b + 3``. Decoding drops ids that are not bytes,
so random tokens from dummy weights still decode to (some) text.
"""

from __future__ import annotations

OFFSET = 3


class ByteTokenizer:
    """UTF-8 bytes as token ids; needs a vocabulary of at least 259."""

    vocab_size = 256 + OFFSET

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (non-byte ids skipped, invalid UTF-8 replaced)."""
        return bytes(i - OFFSET for i in ids if OFFSET <= i < 256 + OFFSET).decode("utf-8", "replace")
