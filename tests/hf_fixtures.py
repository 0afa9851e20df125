"""Small HuggingFace model directories built on the spot (nothing is downloaded): the checkpoints and
tokenizers that the model.path tests load, made the way a user's downloaded model is laid out.

    model_dir(out, "qwen3_moe")    # config.json, 2+ *.safetensors + index (per-expert names),
                                   # generation_config.json, a BPE tokenizer with a chat template
    model_dir(out, "mixtral", fused=True)   # experts as transformers 5.x's fused 3-D tensors

Weights are transformers' own init under `seed` (`hpcrl.trainer.model.build_hf_model`), so a
directory made from a preset config holds exactly the weights `init_from_seed(seed)` draws.
Importable from every test folder (tests/conftest.py puts tests/ on sys.path).
"""

from __future__ import annotations

import json
from pathlib import Path

# A ChatML template (the format of Qwen's templates), with Qwen3's enable_thinking switch so that
# data.chat_template_kwargs has something to act on.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 2+3? The answer is 5.", "Natalia sold clips to 48 of her friends in April.",
    "How many apples are left? #### 42", "Compute \\boxed{7} and \\frac{1}{2}.",
    "user assistant system think", "Repeat the letter: a b c d e f g h", "aaaa bbbb cccc dddd",
    "The quick brown fox jumps over the lazy dog 0123456789.",
]

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 384,
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
    "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_bias": False,
    "tie_word_embeddings": False, "initializer_range": 0.02, "router_aux_loss_coef": 0.01,
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 384, "hidden_size": 64,
    "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "hidden_act": "silu",
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
    "attention_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02,
    "router_aux_loss_coef": 0.01,
}
CONFIGS = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}


def train_tokenizer(out: Path, vocab_size: int = 320, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer trained with `tokenizers` on CORPUS, saved into `out` as
    transformers files (tokenizer.json, tokenizer_config.json). Returns the loaded tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    if chat_template is not None:
        fast.chat_template = chat_template
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def model_dir(out: Path, family: str = "qwen3_moe", *, seed: int = 0, fused: bool = False,
              config: dict | None = None, tokenizer: bool = True, max_shard_size: str = "150KB",
              perturb: float = 0.0) -> Path:
    """Write a HF model directory into `out` and return it.

    `config` (an HF config dict) replaces the family's default small config. The safetensors are
    split into several files (`max_shard_size`) with an index; experts are stored per expert
    (`...experts.{e}.gate_proj.weight`, what hub checkpoints hold) unless `fused`, which keeps
    transformers 5.x's in-memory fused tensors (`...experts.gate_up_proj`). With `tokenizer`, a BPE
    tokenizer with a chat template and a generation_config.json whose eos is `<|im_end|>`.
    `perturb` > 0 adds perturb * N(0, 1) (drawn from `seed`) to every weight and buffer, norms and
    DeepSeek's router bias included: transformers' init leaves those at 1 and 0, and its small router
    weights leave sigmoid routers near-tied.
    """
    from transformers import GenerationConfig

    from hpcrl.trainer.model import build_hf_model

    cfg = dict(config or CONFIGS[family])
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        tok = train_tokenizer(out)
        eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
        cfg.update(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    model = build_hf_model(cfg, seed)
    if perturb:
        import torch

        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point() and t.dim() > 0 and "inv_freq" not in str(t.shape):
                    t.add_(perturb * torch.randn(t.shape, generator=g))
    model.save_pretrained(str(out), max_shard_size=max_shard_size, save_original_format=not fused)
    if tokenizer:
        GenerationConfig(eos_token_id=[eos], pad_token_id=pad).save_pretrained(str(out))
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 2 and (out / "model.safetensors.index.json").is_file(), files
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.0." in n for n in names) != fused, "unexpected expert layout on disk"
    return out


def reward_model_dir(causal_dir: Path, out: Path, *, labels: int = 1, seed: int = 0) -> Path:
    """A one-file reward model of `causal_dir`'s architecture and body, as transformers'
    ...ForSequenceClassification saves it: `lm_head.weight` replaced by a random `score.weight`
    [labels, hidden] (no bias, as Qwen3's), config with that architecture and num_labels."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((causal_dir / "config.json").read_text())
    index = json.loads((causal_dir / "model.safetensors.index.json").read_text())["weight_map"]
    tensors = {}
    for name in sorted(set(index.values())):
        tensors.update(load_file(str(causal_dir / name)))
    del tensors["lm_head.weight"]
    gen = torch.Generator().manual_seed(seed)
    tensors["score.weight"] = torch.randn(labels, cfg["hidden_size"], generator=gen) * 0.02
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    arch = cfg["architectures"][0].replace("ForCausalLM", "ForSequenceClassification")
    cfg.update(architectures=[arch], num_labels=labels)
    (out / "config.json").write_text(json.dumps(cfg))
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        if (causal_dir / extra).is_file():
            shutil.copy(causal_dir / extra, out / extra)
    return out


def validate(tmp: Path, path: Path) -> tuple[int, str]:
    """`hpcrl validate` of a copy-task job with model.path `path` (job file in `tmp`): (exit code,
    output); never a traceback."""
    import subprocess
    import sys

    job = tmp / "job.yaml"
    job.write_text(f"model: {{path: {path}}}\ndata: {{task: copy}}\n")
    proc = subprocess.run([sys.executable, "-m", "hpcrl.cli", "validate", str(job)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stderr + proc.stdout
