"""The model's own tokenizer (model.path) behind the controller's tokenizer interface: loading without
a download, stop ids, chat-template rendering (with chat_template_kwargs), encoding without doubled
special tokens, decoding for the reward. The tokenizer is the BPE one of tests/hf_fixtures.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_fixtures import train_tokenizer
from hpcrl.config import job_from_dict
from hpcrl.tasks import CharTokenizer, ExampleFile, HFTokenizer, PromptFormat, load_tokenizer, prompt_format

pytestmark = pytest.mark.timeout(120)

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
RENDERED = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("model")
    train_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    return d


def job(model_dir: Path | None, **data) -> object:
    return job_from_dict({"model": {"path": str(model_dir)} if model_dir else {}, "data": data})


def test_load_tokenizer_picks_the_model_tokenizer_or_the_character_one(tok_dir, tmp_path):
    tok = load_tokenizer(job(tok_dir))
    assert isinstance(tok, HFTokenizer) and tok.chat_template
    assert tok.vocab_size == 320  # len(tokenizer): trained vocabulary incl. the 3 special tokens
    # generation_config.json's eos list, then the tokenizer's eos (<|im_end|> = 2), without duplicates
    assert tok.stop_token_ids == [0, 2]
    # sft's targets end as the chat template ends an assistant turn: the tokenizer's eos, not the
    # first id of generation_config.json's list (Llama-3.1-Instruct: <|eot_id|>, not <|end_of_text|>)
    assert tok.answer_end_id == 2
    (tmp_path / "config.json").write_text("{}")  # a model directory without tokenizer files
    assert isinstance(load_tokenizer(job(tmp_path)), CharTokenizer)
    assert isinstance(load_tokenizer(job(None)), CharTokenizer)


def test_stop_ids_from_an_int_eos_and_without_generation_config(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train_tokenizer(a)
    train_tokenizer(b)
    (a / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert HFTokenizer(a).stop_token_ids == [1, 2]
    assert HFTokenizer(b).stop_token_ids == [2]


def test_chat_template_rendering_kwargs_and_no_doubled_specials(tok_dir):
    tok = load_tokenizer(job(tok_dir))
    assert tok.render(QUESTION, {}) == RENDERED
    thinking_off = tok.render(QUESTION, {"enable_thinking": False})
    assert thinking_off == RENDERED + "<think>\n\n</think>\n\n"
    ids = tok.encode_prompt(RENDERED, rendered=True)
    assert ids == tok.tok.encode(RENDERED, add_special_tokens=False)
    im_start = tok.tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 2  # each special once, nothing prepended
    # decoding for the reward drops the special tokens
    assert tok.decode(ids) == "user\nWhat is 2+3?\nassistant\n"
    assert tok.decode(tok.encode_prompt("The answer is 5.") + [2]) == "The answer is 5."


def _file(tmp_path: Path, rows: list[dict]) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_message_and_string_prompts_through_the_job_format(tok_dir, tmp_path):
    rows = [{"prompt": QUESTION, "answer": "5"}, {"prompt": "What is 2+3?", "answer": "5"}]
    path = _file(tmp_path, rows)
    j = job(tok_dir, path=str(path), chat_template_kwargs={"enable_thinking": False})
    tok = load_tokenizer(j)
    file = ExampleFile(path, prompt_format(j, tok))
    messages, string = file[0], file[1]
    assert messages.prompt == RENDERED + "<think>\n\n</think>\n\n" and messages.raw_prompt == QUESTION
    # a string prompt becomes one user message when the template is applied
    assert (string.prompt, string.prompt_ids) == (messages.prompt, messages.prompt_ids)
    assert messages.prompt_ids == tuple(tok.encode_prompt(messages.prompt, rendered=True))
    plain = ExampleFile(path, PromptFormat(tok, apply_chat_template=False))
    assert plain[1].prompt == "What is 2+3?" and plain[1].prompt_ids == tuple(tok.tok.encode("What is 2+3?"))
    with pytest.raises(ValueError, match="row 1 has a message-list prompt .* but data.apply_chat_template"):
        plain[0]


def test_a_tokenizer_without_a_chat_template(tmp_path):
    d = tmp_path / "model"
    train_tokenizer(d, chat_template=None)
    tok = load_tokenizer(job(d))
    assert isinstance(tok, HFTokenizer) and not tok.chat_template
    path = _file(tmp_path, [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": QUESTION, "answer": "5"}])
    file = ExampleFile(path, PromptFormat(tok))
    assert file[0].prompt == "What is 2+3?"  # strings go to the tokenizer as they are
    with pytest.raises(ValueError, match=r"row 2 has a message-list prompt \('prompt'\) but the tokenizer of "
                                         r"model.path=.* has no chat template; set model.path"):
        file[1]


CUSTOM_TOKENIZER = '''
from transformers import PreTrainedTokenizer

SPECIALS = ["<pad>", "<s>", "</s>"]


class ByteCharTokenizer(PreTrainedTokenizer):
    """One id per printable ASCII character after three specials: a tokenizer that is the model
    directory's own code, as Kimi-K2's tiktoken one is."""

    vocab_files_names: dict = {}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        self.vocab = {t: i for i, t in enumerate(SPECIALS + [chr(c) for c in range(32, 127)])}
        self.inverse = {i: t for t, i in self.vocab.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, 0)

    def _convert_id_to_token(self, index):
        return self.inverse.get(index, "<pad>")

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def custom_code_tokenizer(d: Path) -> Path:
    """A model directory whose tokenizer is its own Python file, named by tokenizer_config.json's auto_map."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenization_bytechar.py").write_text(CUSTOM_TOKENIZER)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "ByteCharTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_bytechar.ByteCharTokenizer",
                                                                                None]},
        "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}))
    return d


def test_a_tokenizer_that_is_the_directorys_code_runs_only_when_trusted(tmp_path):
    """Refused, naming model.trust_remote_code, without trust (transformers would ask on stdin in every
    rank); with it, the directory's class encodes and its eos stops generation."""
    from hpcrl.config.errors import ConfigError
    from hpcrl.config.validate_data import job_tokenizer
    from hpcrl.tasks.hf_tokenizer import RemoteCodeTokenizerError

    d = custom_code_tokenizer(tmp_path / "kimi_like")
    with pytest.raises(RemoteCodeTokenizerError, match="tokenization_bytechar.ByteCharTokenizer"):
        load_tokenizer(job(d))
    with pytest.raises(ConfigError, match=r"model\.trust_remote_code.*set model\.trust_remote_code: true"):
        job_tokenizer(job(d))
    tok = load_tokenizer(job_from_dict({"model": {"path": str(d), "trust_remote_code": True}}))
    assert type(tok.tok).__name__ == "ByteCharTokenizer"
    assert tok.encode_completion("hi!") == [3 + ord("h") - 32, 3 + ord("i") - 32, 3 + ord("!") - 32]
    assert tok.decode(tok.encode_completion("hi!")) == "hi!" and tok.stop_token_ids == [2]


TIKTOKEN_TOKENIZER = '''
from tiktoken import Encoding
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer


class TiktokenIds(PreTrainedTokenizer):
    """A byte-pair tokenizer read from the directory's tiktoken.model (base64 token, rank per line), as
    Kimi-K2's is; its tokens are the decimal ids, so transformers' string plumbing round-trips them."""

    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        self.specials = {"<|eos|>": len(ranks)}
        self.bpe = Encoding("tiny", pat_str=r"\\S+|\\s+", mergeable_ranks=ranks, special_tokens=self.specials)
        super().__init__(eos_token="<|eos|>", **kwargs)

    @property
    def vocab_size(self):
        return self.bpe.n_vocab

    def get_vocab(self):
        return {**{str(i): i for i in range(self.bpe.n_vocab - len(self.specials))}, **self.specials}

    def _tokenize(self, text):
        return [str(i) for i in self.bpe.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.specials.get(token, int(token) if token.isdigit() else 0)

    def _convert_id_to_token(self, index):
        return next((t for t, i in self.specials.items() if i == index), str(index))

    def convert_tokens_to_string(self, tokens):
        return self.bpe.decode([int(t) for t in tokens if t.isdigit()])

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


def tiktoken_tokenizer(d: Path, imports: str = "") -> Path:
    """A Kimi-K2-like directory: tokenization_tiny.py (its code, on tiktoken) and tiktoken.model (the
    256 bytes, then the merge "hi" at rank 256)."""
    import base64

    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenization_tiny.py").write_text(imports + TIKTOKEN_TOKENIZER)
    tokens = [bytes([b]) for b in range(256)] + [b"hi"]
    (d / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TiktokenIds", "auto_map": {"AutoTokenizer": ["tokenization_tiny.TiktokenIds", None]}}))
    return d


def test_a_tiktoken_tokenizer_in_the_directory_runs_when_trusted(tmp_path):
    """tiktoken is installed with hpcrl (pyproject): a Kimi-K2-like tokenizer loads with trust, encodes
    with the directory's merges and stops on its eos."""
    tok = load_tokenizer(job_from_dict({"model": {"path": str(tiktoken_tokenizer(tmp_path / "kimi")),
                                                  "trust_remote_code": True}}))
    assert type(tok.tok).__name__ == "TiktokenIds" and tok.vocab_size == 258
    assert tok.encode_completion("hi!") == [256, ord("!")]
    assert tok.decode([256, ord("!"), 257]) == "hi!" and tok.stop_token_ids == [257]


def test_a_directory_tokenizer_missing_a_package_names_it(tmp_path):
    """Its code imports a package hpcrl's environment lacks: exit 2 on model.path naming the package and
    where to install it, not "fix or remove the tokenizer files"."""
    from hpcrl.config.errors import ConfigError
    from hpcrl.config.validate_data import job_tokenizer

    d = tiktoken_tokenizer(tmp_path / "needs_more", imports="import hpcrl_no_such_package\n")
    with pytest.raises(ConfigError) as exc:
        job_tokenizer(job_from_dict({"model": {"path": str(d), "trust_remote_code": True}}))
    assert exc.value.path == "model.path"
    assert "hpcrl_no_such_package" in str(exc.value) and "hpcrl's environment" in str(exc.value)
    assert "remove the tokenizer files" not in str(exc.value)


def test_a_prompt_stored_rendered_gets_one_bos(tmp_path):
    """A tokenizer whose post-processor adds BOS (Llama's) and a string prompt that was rendered
    before it was stored (it opens with the BOS text; data.apply_chat_template: false): one BOS, not
    two; a plain string still gets its BOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator(["what is 2+3? the answer is 5."] * 4, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|begin_of_text|>", "<|eot_id|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|begin_of_text|>",
                            eos_token="<|eot_id|>").save_pretrained(str(tmp_path / "llama_like"))
    tok = HFTokenizer(tmp_path / "llama_like")
    stored = tok.encode_prompt("<|begin_of_text|>what is 2+3?")
    plain = tok.encode_prompt("what is 2+3?")
    assert stored == plain and plain[0] == 0 and plain.count(0) == 1
