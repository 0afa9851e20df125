"""Tasks: tokenizers (built-in characters or the model's HF tokenizer), data files, synthetic tasks and
prompt sampling."""

from hpcrl.tasks.examples import Example, ExampleFile, OverlongPrompt, PromptFormat, read_examples
from hpcrl.tasks.hf_tokenizer import HFTokenizer, has_tokenizer, load_tokenizer
from hpcrl.tasks.sampler import PromptSampler, build_sampler, make_sampler, open_examples, prompt_format
from hpcrl.tasks.synthetic import TASKS, Task
from hpcrl.tasks.tokenizer import CharTokenizer, Tokenizer, default_tokenizer

__all__ = ["TASKS", "CharTokenizer", "Example", "ExampleFile", "HFTokenizer", "OverlongPrompt",
           "PromptFormat", "PromptSampler", "Task", "Tokenizer", "build_sampler", "default_tokenizer",
           "has_tokenizer", "load_tokenizer", "make_sampler", "open_examples", "prompt_format", "read_examples"]
