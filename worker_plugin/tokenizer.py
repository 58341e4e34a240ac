"""Tokenizers of the engine hosts: the model's own (what vLLM loads) or the byte tokenizer.

:class:`ModelTokenizer` wraps the model's Hugging Face tokenizer (``tokenizer: auto``): the
engine loads the same one, so vLLM detokenizes, matches stop strings, compiles structured-output
grammars and the worker renders the model's chat template. The built-in tiny-llama ships one
(``scripts/make_tiny_tokenizer.py``) whose ids for plain text are the byte tokenizer's.

:class:`ByteTokenizer` (``tokenizer: byte``, and the emulated engine's) needs no files: ids
0..2 are pad/bos/eos; byte ``b`` is id ``b + 3``. Decoding drops ids that are not bytes, so
random tokens from dummy weights still decode to (some) text. vLLM does not see it (the engine
skips its tokenizer): stop strings and structured outputs are refused on such an engine, and a
chat is rendered with :func:`render_chatml` (the built-in model's own template, in Python).
"""

from __future__ import annotations

import json
import threading
from typing import Any

OFFSET = 3

_IMPORT_LOCK = threading.Lock()  # see ModelTokenizer.load


class ByteTokenizer:
    """UTF-8 bytes as token ids; needs a vocabulary of at least 259."""

    vocab_size = 256 + OFFSET
    in_engine = False  # the engine runs without it (skip_tokenizer_init): no stop strings or grammars there

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        import numpy as np

        # vectorized: a list comprehension over a 56k-token prompt held the GIL ~2 ms a call
        return (np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64) + OFFSET).tolist()

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (non-byte ids skipped, invalid UTF-8 replaced)."""
        return bytes(i - OFFSET for i in ids if OFFSET <= i < 256 + OFFSET).decode("utf-8", "replace")

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The conversation as the text of a prompt (:func:`render_chatml`)."""
        return render_chatml(messages, tools)


class ModelTokenizer:
    """The model's own tokenizer (Hugging Face's, as vLLM loads it); ``hf`` is the object."""

    in_engine = True  # the engine has the same tokenizer: it detokenizes and applies constraints

    def __init__(self, hf: Any):
        self.hf = hf
        self.vocab_size = len(hf)

    @classmethod
    def load(cls, path: str, revision: str | None = None) -> "ModelTokenizer":
        """Load the tokenizer of the model at ``path`` (a folder or a hub name). A folder with a
        ``tokenizer.json`` loads it as a fast tokenizer directly (0.1 GB and a second, where
        ``AutoTokenizer`` imports torch: 0.4 GB in a worker that hosts no model itself)."""
        import os

        # transformers' lazy module is not safe to import from two threads at once: two workers
        # of one process (LocalCluster(processes=False)) loading their engines together failed
        # one with "cannot import name 'PreTrainedTokenizerFast'" when nothing had imported it yet
        with _IMPORT_LOCK:
            if os.path.isfile(os.path.join(path, "tokenizer.json")):
                from transformers import PreTrainedTokenizerFast

                return cls(PreTrainedTokenizerFast.from_pretrained(path))
            from transformers import AutoTokenizer

            return cls(AutoTokenizer.from_pretrained(path, revision=revision))

    def encode(self, text: str) -> list[int]:
        """Token ids of a prompt's text (with the special tokens the model adds, as vLLM does)."""
        return list(self.hf.encode(text))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], tools: list[dict] | None) -> str:
        """The conversation through the model's chat template, with the generation prompt.
        ValueError when the model has none."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template (use generate with a prompt)")
        return self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat (the template wrote the special tokens itself)."""
        return list(self.hf.encode(text, add_special_tokens=False))


def render_chatml(messages: list[dict], tools: list[dict] | None) -> str:
    """ChatML with Hermes-style tools: what the built-in model's template renders, for engines
    without the model's tokenizer (the byte tokenizer, the emulated engine)."""
    out = []
    rest = list(messages)
    system = rest.pop(0)["content"] if rest and rest[0]["role"] == "system" else None
    if tools:
        head = f"{system}\n\n" if system else ""
        sig = "".join(json.dumps(t) + "\n" for t in tools)
        out.append(f"<|im_start|>system\n{head}You may call functions. Their signatures:\n<tools>\n{sig}</tools>\n"
                   'For each call, reply <tool_call>{"name": NAME, "arguments": ARGUMENTS}</tool_call><|im_end|>\n')
    elif system is not None:
        out.append(f"<|im_start|>system\n{system}<|im_end|>\n")
    for m in rest:
        if m["role"] == "assistant":
            calls = "".join(f'<tool_call>{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
                            f'{c["function"]["arguments"]}}}</tool_call>' for c in m.get("tool_calls") or ())
            out.append(f"<|im_start|>assistant\n{m.get('content') or ''}{calls}<|im_end|>\n")
        else:
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def load_tokenizer(settings: Any, emulated: bool = False) -> ByteTokenizer | ModelTokenizer:
    """The tokenizer of an engine with ``settings``: the byte tokenizer for ``tokenizer: byte``
    (and an emulated engine's ``auto``: it has no model files), else the model's own."""
    if settings.tokenizer == "byte" or (emulated and settings.tokenizer == "auto"):
        return ByteTokenizer()
    return ModelTokenizer.load(settings.model_path())
