"""Seeded synthetic text: one ASCII character is one token of the engines' byte tokenizer."""

from __future__ import annotations

import functools
import random

_WORDS = ("def", "class", "return", "self", "if", "else", "for", "in", "import", "from", "None", "True",
          "False", "raise", "with", "as", "try", "except", "yield", "lambda", "async", "await", "assert",
          "cache", "parser", "config", "path", "buffer", "token", "line", "record", "export", "writer",
          "reader", "timezone", "offset", "lock", "thread", "queue", "encode", "decode", "utf8", "value",
          "result", "error", "index", "items", "keys", "len", "open", "close", "flush", "logger", "debug",
          "test_", "fixture", "mock", "expected", "actual", "==", "!=", "+=", "->", "(", ")", ":", ",",
          "[", "]", "{", "}", ".", "=", "0", "1", "-1", "#", "TODO:", "FIXME")


@functools.lru_cache(maxsize=16384)
def synthetic_text(seed: str, n: int) -> str:
    """Exactly ``n`` characters of code-like text, a pure function of the arguments."""
    rng = random.Random(seed)
    words = rng.choices(_WORDS, k=n // 3 + 8)
    seps = rng.choices((" ", "\n"), weights=(92, 8), k=len(words))
    text = "".join(w + s for w, s in zip(words, seps))
    while len(text) < n:
        text += text
    return text[:n]
