"""A small character-level tokenizer shipped with hpcrl (no download at run time).

One token per character of a fixed alphabet plus four specials. The vocabulary lives in
`hpcrl/tasks/char_vocab.json` so that engines (reference or SGLang via `tokenizer_path`) and the
trainer agree on ids. Unknown characters map to `<unk>`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

VOCAB_PATH = Path(__file__).with_name("char_vocab.json")


class CharTokenizer:
    """Maps text to token ids one character at a time. `vocab_size` includes unused padding ids."""

    def __init__(self, vocab_path: Path = VOCAB_PATH) -> None:
        spec = json.loads(vocab_path.read_text())
        self.tokens: list[str] = spec["tokens"]
        self.vocab_size: int = spec["vocab_size"]
        self._id = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id = self._id["<pad>"]
        self.bos_id = self._id["<bos>"]
        self.eos_id = self._id["<eos>"]
        self.unk_id = self._id["<unk>"]

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self._id.get(ch, self.unk_id) for ch in text]
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; specials and ids past the alphabet are dropped, decoding stops at <eos>."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if 4 <= i < len(self.tokens):
                out.append(self.tokens[i])
        return "".join(out)


@lru_cache(maxsize=1)
def default_tokenizer() -> CharTokenizer:
    return CharTokenizer()
