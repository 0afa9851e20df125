"""The tokenizer interface of the controller, and a small character-level tokenizer shipped with hpcrl.

Every tokenizer the controller uses offers `encode_prompt(prompt) -> ids`, `decode(ids) -> str`,
`stop_token_ids`, `vocab_size`, `chat_template` (bool: message-list prompts can be rendered),
`render(messages, kwargs)`, `unknown_chars(text)` and `name` (see `Tokenizer`). The character
tokenizer (no download at run time) serves the synthetic tasks and any job whose `model.path` has no
tokenizer files: one token per character of a fixed alphabet plus four specials. Its vocabulary lives
in `hpcrl/tasks/char_vocab.json` so that engines (reference or SGLang via `tokenizer_path`) and the
trainer agree on ids. `encode` maps unknown characters to `<unk>`; prompts from files are checked
with `unknown_chars` first (hpcrl/tasks/examples.py), so no prompt reaches the model with `<unk>`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

VOCAB_PATH = Path(__file__).with_name("char_vocab.json")


class Tokenizer(Protocol):
    """What the controller needs of a tokenizer (CharTokenizer, hf_tokenizer.HFTokenizer)."""

    name: str
    """How messages name it, e.g. "the built-in character tokenizer"."""
    vocab_size: int
    """Ids the tokenizer can produce (must fit the model's embedding)."""
    stop_token_ids: list[int]
    """Ids that end a completion (the engines' stop_token_ids)."""
    answer_end_id: int | None
    """The stop id that ends a supervised target (sft): the tokenizer's eos, which a chat model's
    template writes after an assistant turn (Llama-3.1-Instruct's <|eot_id|>, not the first id of
    generation_config.json's list, <|end_of_text|>); None when there is no stop id at all."""
    chat_template: bool
    """True when `render` can turn a message list into prompt text."""

    def encode_prompt(self, text: str, rendered: bool) -> list[int]:
        """Prompt ids of `text`; `rendered`: text came from `render` (its specials are in the text)."""
        ...

    def encode_completion(self, text: str) -> list[int]:
        """Ids of `text` as a completion (no special tokens added): SFT targets."""
        ...

    def render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        """The chat template applied to `messages` with the generation prompt."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Completion text for the reward, special tokens dropped."""
        ...

    def unknown_chars(self, text: str) -> list[str]:
        """Characters of `text` the tokenizer cannot represent (sorted, distinct)."""
        ...


class CharTokenizer:
    """Maps text to token ids one character at a time. `vocab_size` includes unused padding ids."""

    name = "the built-in character tokenizer"
    chat_template = False

    def __init__(self, vocab_path: Path = VOCAB_PATH) -> None:
        spec = json.loads(vocab_path.read_text())
        self.tokens: list[str] = spec["tokens"]
        self.vocab_size: int = spec["vocab_size"]
        self._id = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id = self._id["<pad>"]
        self.bos_id = self._id["<bos>"]
        self.eos_id = self._id["<eos>"]
        self.unk_id = self._id["<unk>"]
        self.stop_token_ids = [self.eos_id]
        self.answer_end_id = self.eos_id
        self.alphabet = "".join(t for t in self.tokens if len(t) == 1)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self._id.get(ch, self.unk_id) for ch in text]
        return [self.bos_id, *ids] if add_bos else ids

    def encode_prompt(self, text: str, rendered: bool = False) -> list[int]:
        """<bos> then one id per character."""
        return self.encode(text)

    def encode_completion(self, text: str) -> list[int]:
        return self.encode(text, add_bos=False)

    def render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        raise ValueError(f"{self.name} has no chat template; set model.path to a model directory with a "
                         "tokenizer that has one")

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; specials and ids past the alphabet are dropped, decoding stops at <eos>."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if 4 <= i < len(self.tokens):
                out.append(self.tokens[i])
        return "".join(out)

    def unknown_chars(self, text: str) -> list[str]:
        return sorted(set(text) - set(self.alphabet))


@lru_cache(maxsize=1)
def default_tokenizer() -> CharTokenizer:
    return CharTokenizer()
