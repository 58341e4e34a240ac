"""Write the built-in tiny-llama's tokenizer files (an offline tool: nothing at runtime imports it).

``python scripts/make_tiny_tokenizer.py`` writes ``tokenizer.json`` and ``tokenizer_config.json``
beside ``worker_plugin/models/tiny-llama/config.json``. The tokenizer is byte-level with the
byte tokenizer's ids (``worker_plugin/tokenizer.py``: 0..2 pad/bos/eos, byte ``b`` is id
``b + 3``), so plain text encodes to the same ids with either, plus the tokens a chat model
needs: ``<|im_start|>``/``<|im_end|>`` (ChatML turns), ``<tool_call>``/``</tool_call>``
(Hermes-style tool calls, what vLLM's ``hermes`` tool parser reads) and reserved tokens up to
the model's vocabulary of 1,024, so every id a dummy-weight model samples decodes. The chat
template is ChatML with tools listed in the system turn, as Hermes/Qwen models do.

With it vLLM loads the model's own tokenizer (``tokenizer: auto``): stop strings, structured
outputs (the grammar needs the vocabulary), chat templates and tool parsers all work on the
built-in model as on a real one.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "worker_plugin", "models", "tiny-llama")
VOCAB = 1024  # config.json's vocab_size
OFFSET = 3  # ids 0..2 are pad, bos, eos (worker_plugin/tokenizer.py's OFFSET)

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call functions. Their signatures:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nFor each call, reply <tool_call>{\"name\": NAME, \"arguments\": ARGUMENTS}</tool_call>"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if not (loop.first and m.role == 'system') %}"
    "{% if m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in (m.tool_calls or []) %}"
    "{% set f = c.function if c.function is defined else c %}"
    "<tool_call>{\"name\": {{ f.name | tojson }}, \"arguments\": "
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}"
    "</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# (content, special): special tokens are dropped when output is decoded; the tool-call tags are
# not, so a tool parser finds them in the text.
ADDED = [("<|im_start|>", True), ("<|im_end|>", True), ("<tool_call>", False), ("</tool_call>", False)]


def build() -> Tokenizer:
    """The tokenizer (see the module docstring)."""
    alphabet = ByteLevel.alphabet()  # the 256 characters ByteLevel maps bytes to
    byte_to_char = _bytes_to_unicode()
    assert sorted(byte_to_char.values()) == sorted(alphabet)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[byte_to_char[b]] = b + OFFSET
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "<s>", "</s>")])
    for content, special in ADDED:
        if special:
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        else:
            tok.add_tokens([AddedToken(content, special=False, normalized=False)])
    n = tok.get_vocab_size(with_added_tokens=True)
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
                            for i in range(VOCAB - n)])
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character map (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def main() -> None:
    tok = build()
    tok.save(os.path.join(OUT, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    # a check: plain text has the byte tokenizer's ids
    text = "def f(x):\n    return 'é' + x  # ok"
    assert tok.encode(text).ids == [b + OFFSET for b in text.encode("utf-8")]
    assert tok.decode(tok.encode(text).ids) == text
    print(f"wrote {OUT}/tokenizer.json and tokenizer_config.json ({VOCAB} ids)")


if __name__ == "__main__":
    main()
