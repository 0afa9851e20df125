"""Tasks: the built-in tokenizer, synthetic tasks and prompt sampling."""

from hpcrl.tasks.sampler import Example, PromptSampler, make_sampler, read_examples
from hpcrl.tasks.synthetic import TASKS, Task
from hpcrl.tasks.tokenizer import CharTokenizer, default_tokenizer

__all__ = ["TASKS", "CharTokenizer", "Example", "PromptSampler", "Task", "default_tokenizer",
           "make_sampler", "read_examples"]
