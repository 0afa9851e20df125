"""A HuggingFace tokenizer from the job's model directory, behind the controller's `Tokenizer` interface.

`load_tokenizer(job)` returns `HFTokenizer` when `model.path` holds tokenizer files
(tokenizer.json or tokenizer_config.json), else the built-in `CharTokenizer`. The directory is read
with `AutoTokenizer.from_pretrained(dir, local_files_only=True)`: nothing is downloaded.

- A tokenizer that is the directory's own Python code (tokenizer_config.json's `auto_map`, e.g.
  Kimi-K2's tiktoken tokenizer) is run only with `model.trust_remote_code: true`; without it,
  `RemoteCodeTokenizerError` (transformers would otherwise ask on stdin, in every rank).

- Prompt text rendered by the chat template already holds the template's special tokens (a BOS
  included, when the template writes one), so it is encoded with `add_special_tokens=False`; plain
  string prompts are encoded with the tokenizer's own specials (`add_special_tokens=True`), as
  `tokenizer(prompt)` would.
- `stop_token_ids`: generation_config.json's `eos_token_id` (an int or a list), then the tokenizer's
  eos, without duplicates.
- `vocab_size` is `len(tokenizer)` (added tokens included): the ids the model's embedding must hold.
- `decode` skips special tokens.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.tasks.tokenizer import CharTokenizer, Tokenizer, default_tokenizer

if TYPE_CHECKING:
    from hpcrl.config.schema import JobConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def has_tokenizer(model_dir: Path) -> bool:
    """True when `model_dir` holds a HF tokenizer (tokenizer.json or tokenizer_config.json)."""
    return any((model_dir / f).is_file() for f in TOKENIZER_FILES)


class RemoteCodeTokenizerError(ValueError):
    """The directory's tokenizer is its own Python code and model.trust_remote_code is false."""


def tokenizer_code(model_dir: Path) -> str | None:
    """The Python class tokenizer_config.json's auto_map names for AutoTokenizer, or None."""
    config = model_dir / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        entry = (json.loads(config.read_text()).get("auto_map") or {}).get("AutoTokenizer")
    except (ValueError, AttributeError):
        return None  # transformers reports a broken file itself
    names = [entry] if isinstance(entry, str) else [n for n in entry or () if n]
    return names[0] if names else None


class HFTokenizer:
    """A transformers tokenizer loaded from a local directory (see the module docstring)."""

    def __init__(self, model_dir: Path, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        self.dir = model_dir
        self.name = f"the tokenizer of model.path={str(model_dir)!r}"
        code = tokenizer_code(model_dir)
        if code and not trust_remote_code:
            raise RemoteCodeTokenizerError(
                f"the tokenizer is the directory's own code ({code}, tokenizer_config.json auto_map); "
                f"set model.trust_remote_code: true to run it")
        self.tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True,
                                                 trust_remote_code=trust_remote_code)
        self.vocab_size: int = len(self.tok)
        self.chat_template: bool = bool(getattr(self.tok, "chat_template", None))
        self.stop_token_ids = _stop_ids(model_dir, self.tok.eos_token_id)
        eos = self.tok.eos_token_id
        self.answer_end_id = int(eos) if eos is not None else next(iter(self.stop_token_ids), None)

    def encode_prompt(self, text: str, rendered: bool = False) -> list[int]:
        """Rendered text holds its template's specials; other text gets the tokenizer's own, but no
        second BOS where the text already opens with it (a prompt rendered before it was stored, as
        slime's and OpenRLHF's data often are)."""
        ids = list(self.tok.encode(text, add_special_tokens=not rendered))
        bos = self.tok.bos_token_id
        if not rendered and bos is not None and ids[:2] == [bos, bos]:
            return ids[1:]
        return ids

    def encode_completion(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        if not self.chat_template:
            raise ValueError(f"{self.name} has no chat template (no chat_template in tokenizer_config.json "
                             "nor chat_template.jinja)")
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert isinstance(text, str), type(text)
        return text

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=True))

    def unknown_chars(self, text: str) -> list[str]:
        """Byte-level and sentencepiece-with-fallback tokenizers represent every character; one
        with an unk token is checked by encoding."""
        unk = self.tok.unk_token_id
        if unk is None:
            return []
        return sorted({ch for ch in set(text) if unk in self.tok.encode(ch, add_special_tokens=False)})


def _stop_ids(model_dir: Path, tokenizer_eos: int | None) -> list[int]:
    ids: list[int] = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    return list(dict.fromkeys(int(i) for i in ids))


@lru_cache(maxsize=4)
def _load_dir(model_dir: str, trust_remote_code: bool) -> HFTokenizer:
    return HFTokenizer(Path(model_dir), trust_remote_code)


def load_tokenizer(job: JobConfig) -> Tokenizer:
    """The job's tokenizer: `model.path`'s HF tokenizer when it has one, else the character tokenizer.

    Cached per directory (validation and the controller load it once each process).
    """
    if job.model.path:
        model_dir = Path(job.base_dir, job.model.path).resolve()
        if has_tokenizer(model_dir):
            return _load_dir(str(model_dir), job.model.trust_remote_code)
    return default_tokenizer()


__all__ = ["CharTokenizer", "HFTokenizer", "RemoteCodeTokenizerError", "has_tokenizer", "load_tokenizer"]
