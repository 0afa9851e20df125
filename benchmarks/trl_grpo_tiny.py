"""TRL's GRPOTrainer on hpcrl's benchmark problem: the baseline of benchmarks/e2e_vs_trl.py.

Runs inside the benchmark environment (`bash benchmarks/setup_trl_env.sh` makes .venv-bench; TRL is
never installed in hpcrl's .venv). Everything that defines the problem comes from the hpcrl
repository, imported by path: the model config (hpcrl/models/configs/<preset>.json, HF
Qwen3MoeForCausalLM with the weights transformers draws under the trainer seed -- the same draw as
hpcrl's `build_hf_model`, so both start from bit-identical weights), the prompt sampler, the
character vocabulary and the reward. The vocabulary is wrapped as a PreTrainedTokenizerFast built in
memory (one token per character, `<bos>` prepended), so nothing is downloaded.

TRL is configured to run the same algorithm as hpcrl's job file: fp32, CPU, no gradient
checkpointing, beta (KL) 0, one optimizer step per generation batch (num_iterations 1), token-mean
loss (`dapo`), group-std advantages, clip 0.2, constant lr, Adam (weight decay 0), no grad clip,
temperature 1, MoE aux loss with the same coefficient. `--fixed-length` forces every completion to
`--max-new-tokens` tokens (min_new_tokens = max_new_tokens; hpcrl's counterpart is
`rollout.ignore_eos`).

Writes OUT_DIR/metrics.jsonl with hpcrl's key names (`time`, `reward/mean`, `rollout/tokens`,
`timing/{rollout,reward,logprobs,train,step}_s`, plus `timing/prepare_other_s`) and OUT_DIR/summary.json.
Phases: rollout = `model.generate`; logprobs = old log-prob passes inside TRL's batch preparation
(none in this on-policy setting: TRL reuses the training forward); train = the rest of the step
(loss forward, backward, optimizer).

    .venv-bench/bin/python benchmarks/trl_grpo_tiny.py --out-dir /tmp/trl --num-steps 30
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

T_PROCESS0 = time.time()  # before the heavy imports: start-up is measured from here

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from hpcrl.rewards.builtin import BUILTIN_REWARDS  # noqa: E402
from hpcrl.tasks.sampler import make_sampler  # noqa: E402
from hpcrl.tasks.tokenizer import VOCAB_PATH  # noqa: E402

CONFIG_DIR = REPO / "hpcrl" / "models" / "configs"


def char_tokenizer() -> PreTrainedTokenizerFast:
    """hpcrl's character vocabulary as a fast tokenizer: "c" -> [<bos>, c]; decode joins characters.

    Ids past the alphabet (up to vocab_size) become special `<unusedN>` tokens, so decoding with
    skip_special_tokens drops them, as hpcrl's CharTokenizer.decode does."""
    spec = json.loads(VOCAB_PATH.read_text())
    tokens = list(spec["tokens"]) + [f"<unused{i}>" for i in range(len(spec["tokens"]), spec["vocab_size"])]
    specials = [t for t in tokens if t.startswith("<") and t.endswith(">")]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")


def build_model(preset: str, seed: int, aux_loss_coef: float) -> torch.nn.Module:
    """The preset's HF model with the weights drawn under `seed` (as hpcrl's build_hf_model)."""
    hf = json.loads((CONFIG_DIR / f"{preset}.json").read_text())
    kwargs = {k: v for k, v in hf.items() if k != "model_type"}
    kwargs["router_aux_loss_coef"] = aux_loss_coef
    conf = AutoConfig.for_model(hf["model_type"], **kwargs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    return model


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with per-phase wall clocks; behaviour unchanged (each hook calls super)."""

    def __init__(self, *args, **kwargs) -> None:
        self.phase_s: dict[str, float] = {}
        self.step_tokens = 0
        self.step_rewards: list[float] = []
        self._in_prepare = False
        super().__init__(*args, **kwargs)

    def _add(self, name: str, t0: float) -> None:
        self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - t0

    def _generate_and_score_completions(self, inputs):
        t0, self._in_prepare = time.perf_counter(), True
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self._in_prepare = False
            self._add("prepare", t0)

    def _generate_single_turn(self, *args, **kwargs):
        t0 = time.perf_counter()
        completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
        self._add("rollout", t0)
        self.step_tokens += sum(len(c) for c in completion_ids)
        return completion_ids, logprobs

    def _calculate_rewards(self, *args, **kwargs):
        t0 = time.perf_counter()
        rewards_NF = super()._calculate_rewards(*args, **kwargs)
        self._add("reward", t0)
        self.step_rewards = rewards_NF.sum(dim=1).tolist()
        return rewards_NF

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        if not self._in_prepare:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        finally:
            self._add("logprobs", t0)


class StepRecorder(TrainerCallback):
    """Writes one hpcrl-style metrics record per optimizer step."""

    def __init__(self, trainer: TimedGRPOTrainer, path: Path) -> None:
        self.trainer, self.file, self.records = trainer, path.open("w"), []

    def on_step_begin(self, args, state, control, **kwargs):
        self.t0 = time.perf_counter()
        self.trainer.phase_s, self.trainer.step_tokens = {}, 0

    def on_step_end(self, args, state, control, **kwargs):
        step_s = time.perf_counter() - self.t0
        p, tr = self.trainer.phase_s, self.trainer
        known = p.get("rollout", 0.0) + p.get("reward", 0.0) + p.get("logprobs", 0.0)
        rec = {"step": state.global_step - 1, "time": round(time.time(), 3),
               "reward/mean": sum(tr.step_rewards) / max(1, len(tr.step_rewards)),
               "rollout/tokens": tr.step_tokens,
               "timing/rollout_s": round(p.get("rollout", 0.0), 6),
               "timing/reward_s": round(p.get("reward", 0.0), 6),
               "timing/logprobs_s": round(p.get("logprobs", 0.0), 6),
               "timing/prepare_other_s": round(p.get("prepare", 0.0) - known, 6),
               "timing/train_s": round(step_s - p.get("prepare", 0.0), 6),
               "timing/step_s": round(step_s, 6)}
        self.records.append(rec)
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, required=True, help="writes metrics.jsonl and summary.json here")
    ap.add_argument("--preset", default="tiny-qwen3-moe", help="model config in hpcrl/models/configs/")
    ap.add_argument("--task", default="copy", help="hpcrl synthetic task")
    ap.add_argument("--reward", default="token_match", choices=sorted(BUILTIN_REWARDS))
    ap.add_argument("--num-steps", type=int, default=30)
    ap.add_argument("--num-prompts", type=int, default=8, help="distinct prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--fixed-length", action="store_true", help="every completion is max-new-tokens long")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--aux-loss-coef", type=float, default=0.01)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=1234, help="weight init and sampling (hpcrl trainer.seed)")
    ap.add_argument("--data-seed", type=int, default=0, help="prompt sampler seed (hpcrl data.seed)")
    args = ap.parse_args(argv)
    if not (CONFIG_DIR / f"{args.preset}.json").exists():
        ap.error(f"--preset={args.preset!r}: no {CONFIG_DIR}/{args.preset}.json")
    for name in ("num_steps", "num_prompts", "group_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    sampler = make_sampler(args.task, None, "prompt", "answer", args.num_prompts, args.data_seed)
    # Step s of TRL takes rows [s*P, (s+1)*P) (no shuffling): hpcrl's prompts of step s, in order.
    rows = [{"prompt": ex.prompt, "answer": ex.answer}
            for step in range(args.num_steps) for ex in sampler.batch(step)]
    reward_fn = BUILTIN_REWARDS[args.reward]

    def reward(prompts, completions, answer, **_):
        return [reward_fn(p, c, a) for p, c, a in zip(prompts, completions, answer)]
    reward.__name__ = args.reward

    batch = args.num_prompts * args.group_size
    config = GRPOConfig(
        output_dir=str(args.out_dir / "trl"), report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        seed=args.seed, data_seed=args.seed, shuffle_dataset=False, dataloader_num_workers=0,
        max_steps=args.num_steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=args.group_size, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=1.0, top_k=0,
        generation_kwargs={"min_new_tokens": args.max_new_tokens} if args.fixed_length else None,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=0.0,
        beta=0.0, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        router_aux_loss_coef=args.aux_loss_coef,
    )
    model = build_model(args.preset, args.seed, args.aux_loss_coef)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=config,
                               train_dataset=Dataset.from_list(rows), processing_class=char_tokenizer())
    recorder = StepRecorder(trainer, args.out_dir / "metrics.jsonl")
    trainer.add_callback(recorder)
    t_train0 = time.time()
    trainer.train()
    t_end = time.time()
    summary = {"backend": "trl", "num_steps": args.num_steps, "startup_s": round(t_train0 - T_PROCESS0, 3),
               "train_loop_s": round(t_end - t_train0, 3), "process_s": round(t_end - T_PROCESS0, 3),
               "torch_threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
