"""Job file loading and validation: every bad input is a ConfigError naming the YAML key, the bad
value and the fix; good files give the typed config with defaults, overrides and resolved paths."""

from __future__ import annotations

import dataclasses
import json
import re
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from deepseek_dirs import deepseek_v2_config
from hf_fixtures import MIXTRAL
from hpcrl.config import (ConfigError, JobConfig, job_from_dict, load_job, to_dict, valid_keys,
                          validate)
from hpcrl.models.presets import CONFIG_DIR

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]

# A Qwen3-MoE-shaped config with room for several layouts (heads 8, kv 4, 8 experts, 4 layers).
MID_MODEL = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 48, "intermediate_size": 128,
             "max_position_embeddings": 64,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def model_file(tmp_path: Path, **changes: object) -> None:
    cfg = {**MID_MODEL, **changes}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (tmp_path / "model.json").write_text(json.dumps(cfg))


def data_file(tmp_path: Path, text: str) -> None:
    (tmp_path / "train.jsonl").write_text(textwrap.dedent(text))


# (id, job yaml, --set overrides, setup(tmp_path) or None, expected ConfigError.path,
#  text that shows the bad value, a word of the hint)
def deepseek_json(**changes):
    """A `setup` writing tmp/model.json: the tiny-deepseek-v3 preset with `changes`."""
    cfg = {**json.loads((CONFIG_DIR / "tiny-deepseek-v3.json").read_text()), **changes}
    return lambda p: (p / "model.json").write_text(json.dumps(cfg))


BAD = [
    ("unknown-section", "modle: {preset: tiny-qwen3-moe}", [], None,
     "modle", "modle", "did you mean 'model'"),
    ("unknown-key", "algorithm: {lrr: 0.1}", [], None, "algorithm.lrr", "0.1", "did you mean 'lr'"),
    ("base-dir-not-a-key", "base_dir: /tmp", [], None, "base_dir", "/tmp", "valid keys"),
    ("int-from-word", "algorithm: {group_size: eight}", [], None,
     "algorithm.group_size", "'eight'", "integer"),
    ("bool-for-int", "trainer: {tp: true}", [], None, "trainer.tp", "True", "boolean"),
    ("float-for-int", "trainer: {num_procs: 2.5}", [], None, "trainer.num_procs", "2.5", "integer"),
    ("float-from-word", "algorithm: {lr: fast}", [], None, "algorithm.lr", "'fast'", "number"),
    ("float-infinite", "algorithm: {lr: .inf}", [], None, "algorithm.lr", "inf", "finite"),
    ("bool-from-string", "logging: {tensorboard: 'yes please'}", [], None, "logging.tensorboard",
     "'yes please'", "true or false"),
    ("null-not-allowed", "algorithm: {lr: null}", [], None, "algorithm.lr", "None", "null is not allowed"),
    ("str-expected", "name: 123", [], None, "name", "123", "quote"),
    ("list-expected", "rollout: {server_args: --foo}", [], None, "rollout.server_args", "'--foo'", "list"),
    ("list-item-type", "rollout: {server_args: [--mem-fraction-static, 0.8]}", [], None,
     "rollout.server_args[1]", "0.8", "string"),
    ("section-not-mapping", "model: tiny-qwen3-moe", [], None, "model", "'tiny-qwen3-moe'", "mapping"),
    ("bad-name", "name: my job", [], None, "name", "'my job'", "letters"),
    ("lr-zero", "algorithm: {lr: 0}", [], None, "algorithm.lr", "0.0", "> 0"),
    ("top-p-above-1", "rollout: {top_p: 1.5}", [], None, "rollout.top_p", "1.5", "(0, 1]"),
    ("temperature-zero", "rollout: {temperature: 0}", [], None, "rollout.temperature", "0.0", ">= 1e-06"),
    ("timeout-huge", "resources: {timeout_s: 1.0e12}", [], None, "resources.timeout_s", "1000000000000.0",
     "in (0, 604800] seconds"),
    ("temperature-greedy", "rollout: {temperature: 5.0e-7}", [], None, "rollout.temperature", "5e-07",
     "below it SGLang samples greedily"),
    ("clip-eps-1", "algorithm: {clip_eps: 1.0}", [], None, "algorithm.clip_eps", "1.0", "(0, 1)"),
    ("beta2-1", "algorithm: {adam_beta2: 1}", [], None, "algorithm.adam_beta2", "1.0", "[0, 1)"),
    ("group-size-1", "algorithm: {group_size: 1}", [], None, "algorithm.group_size", "1", ">= 2"),
    ("negative-seed", "data: {seed: -1}", [], None, "data.seed", "-1", "in [0, 2**63)"),
    ("huge-seed", "trainer: {seed: 9223372036854775808}", [], None, "trainer.seed", "9223372036854775808",
     "in [0, 2**63)"),
    ("keep-0", "checkpoint: {keep: 0}", [], None, "checkpoint.keep", "0", ">= 1"),
    ("kl-estimator", "algorithm: {kl_estimator: k4}", [], None,
     "algorithm.kl_estimator", "'k4'", "k1, k2, k3"),
    ("loss-agg", "algorithm: {loss_agg: token_mean}", [], None, "algorithm.loss_agg", "'token_mean'",
     "did you mean 'token-mean'"),
    ("algorithm-name", "algorithm: {name: ppo2}", [], None, "algorithm.name", "'ppo2'", "grpo"),
    ("critic-without-ppo", "critic: {lr: 0.01}", [], None, "critic.lr", "0.01", "algorithm.name: ppo"),
    ("critic-path-missing", "algorithm: {name: ppo}\ncritic: {path: nowhere}", [], None, "critic.path", "nowhere",
     "has no weights"),
    ("gae-without-ppo", "algorithm: {lam: 0.95}", [], None, "algorithm.lam", "0.95", "ppo only"),
    ("lam-range", "algorithm: {name: ppo, lam: 1.5}", [], None, "algorithm.lam", "1.5", "in [0, 1]"),
    ("kl-target-without-coef", "algorithm: {name: ppo, kl_target: 6}", [], None, "algorithm.kl_target", "6",
     "kl_coef: set it > 0"),
    ("critic-warmup-too-long", "algorithm: {name: ppo, num_steps: 5}\ncritic: {warmup_steps: 5}", [], None,
     "critic.warmup_steps", "5", "policy never trains"),
    ("lr-schedule", "algorithm: {lr_schedule: cosine_decay}", [], None, "algorithm.lr_schedule",
     "'cosine_decay'", "constant, linear, cosine"),
    ("lr-warmup-too-long", "algorithm: {num_steps: 10, lr_warmup_steps: 10}", [], None,
     "algorithm.lr_warmup_steps", "10", "below algorithm.num_steps=10"),
    ("min-lr-ratio-range", "algorithm: {lr_schedule: linear, min_lr_ratio: 2}", [], None,
     "algorithm.min_lr_ratio", "2", "in [0, 1]"),
    ("min-lr-ratio-constant", "algorithm: {min_lr_ratio: 0.1}", [], None, "algorithm.min_lr_ratio", "0.1",
     "decaying algorithm.lr_schedule"),
    ("entropy-coef-negative", "algorithm: {entropy_coef: -0.01}", [], None, "algorithm.entropy_coef", "-0.01",
     ">= 0 (0 disables the entropy bonus)"),
    ("aux-loss-coef-negative", "algorithm: {aux_loss_coef: -0.001}", [], None, "algorithm.aux_loss_coef",
     "-0.001", "or null (the model's config.json)"),
    ("entropy-coef-sft", "algorithm: {name: sft, entropy_coef: 0.01}", [], None, "algorithm.entropy_coef",
     "0.01", "sft fits the data's answers"),
    ("dispatcher", "trainer: {dispatcher: all2all}", [], None,
     "trainer.dispatcher", "'all2all'", "allgather"),
    ("backend", "rollout: {backend: vllm}", [], None, "rollout.backend", "'vllm'", "reference, sglang"),
    ("weight-sync", "rollout: {weight_sync: p2p}", [], None, "rollout.weight_sync", "'p2p'",
     "auto, shard, broadcast"),
    ("sync-checksum", "rollout: {sync_checksum: crc32}", [], None, "rollout.sync_checksum", "'crc32'",
     "sampled, full, off"),
    ("device", "resources: {device: gpu}", [], None, "resources.device", "'gpu'",
     "cpu, cuda (did you mean 'cuda'?)"),
    ("cpu-bind", "resources: {cpu_bind: cores}", [], None, "resources.cpu_bind", "'cores'", "none, auto"),
    ("dtype", "model: {dtype: fp16}", [], None, "model.dtype", "'fp16'", "float32, bfloat16"),
    ("unknown-preset", "model: {preset: tiny-qwen3}", [], None, "model.preset", "'tiny-qwen3'",
     "did you mean 'tiny-qwen3-moe'"),
    ("no-model", "model: {preset: null}", [], None, "model.preset", "None", "or model.config_path"),
    ("config-path-missing", "model: {config_path: nowhere/config.json}", [], None, "model.config_path",
     "nowhere/config.json", "no such file"),
    ("config-path-dir", "model: {config_path: .}", [], None, "model.config_path", "='/", "is a directory"),
    ("config-not-json", "model: {config_path: model.json}", [],
     lambda p: (p / "model.json").write_text("{oops"), "model.config_path", "model.json", "not a json"),
    ("config-lacks-key", "model: {config_path: model.json}", [], lambda p: model_file(p, num_experts=None),
     "model.config_path", "model.json", "lacks the key 'num_experts'"),
    ("config-unsupported", "model: {config_path: model.json}", [],
     lambda p: model_file(p, model_type="llama"), "model.config_path", "model.json", "not supported"),
    # 4 layers x 64 experts x 3 x 4096 x 4096: ~13B parameters, all drawn on one rank by transformers' init
    ("hf-init-too-big", "model: {config_path: model.json, random_init: hf}", [],
     lambda p: model_file(p, hidden_size=4096, moe_intermediate_size=4096, num_experts=64),
     "model.random_init", "'hf'", "use sharded"),
    ("unknown-task", "data: {task: cpy}", [], None, "data.task", "'cpy'", "did you mean 'copy'"),
    ("data-missing", "data: {path: data/train.jsonl}", [], None,
     "data.path", "data/train.jsonl", "no such file"),
    ("data-bad-json", "data: {path: train.jsonl}", [],
     lambda p: data_file(p, '{"prompt": "a", "answer": "b"}\n{nope\n'), "data.path", "train.jsonl", "line 2"),
    ("data-missing-key", "data: {path: train.jsonl, answer_key: solution}", [],
     lambda p: data_file(p, '{"prompt": "a", "answer": "b"}\n'), "data.path", "train.jsonl", "answer_key"),
    ("reward-unknown", "reward: {fn: tokn_match}", [], None, "reward.fn", "'tokn_match'",
     "did you mean 'token_match'"),
    ("reward-no-module", "reward: {fn: 'no_such_pkg.rewards:score'}", [], None, "reward.fn",
     "no_such_pkg.rewards:score", "cannot import"),
    ("ep-experts", "trainer: {ep: 3, num_procs: 3}", [], None, "trainer.ep", "3", "valid ep: 1, 2, 4"),
    ("tp-heads", "trainer: {tp: 3, num_procs: 3}", [], None, "trainer.tp", "3", "valid tp for this model"),
    ("tp-kv-heads", "trainer: {tp: 4, num_procs: 4}", [], None, "trainer.tp", "4",
     "num_key_value_heads=2 of preset 'tiny-qwen3-moe' is not divisible by tp=4"),
    ("tp-vocab", "model: {config_path: model.json}\ntrainer: {tp: 4, num_procs: 4}", [],
     lambda p: model_file(p, vocab_size=130), "trainer.tp", "4", "vocab_size=130"),
    ("pp-layers", "trainer: {pp: 3, num_procs: 3}", [], None, "trainer.pp", "3", "valid pp with even stages: 1, 2"),
    ("etp-ffn", "model: {config_path: model.json}\ntrainer: {etp: 5, num_procs: 5, dispatcher: allgather}",
     [],
     lambda p: model_file(p, moe_intermediate_size=48), "trainer.etp", "5", "expert ffn size=48"),
    ("ranks-add-up", "trainer: {tp: 2, ep: 4, num_procs: 6}", [], None, "trainer.num_procs", "6",
     "valid num_procs: 4, 8, 12"),
    ("etp-alltoall-cpu", "trainer: {ep: 2, etp: 2, num_procs: 4}", [], None, "trainer.etp", "2", "allgather"),
    ("tied-embeddings-pp-cpu", "model: {config_path: model.json}\ntrainer: {pp: 2, num_procs: 2}", [],
     lambda p: model_file(p, tie_word_embeddings=True), "trainer.pp", "2", "set trainer.pp=1"),
    ("etp-not-tp-without-ep", "trainer: {tp: 2, num_procs: 2}", [], None, "trainer.etp", "1",
     "set trainer.etp=2"),
    ("batch-split", "algorithm: {group_size: 3}\ndata: {num_prompts_per_step: 3}\ntrainer: {num_procs: 2}",
     [],
     None, "data.num_prompts_per_step", "3", "valid num_prompts_per_step: 2, 4"),
    ("reference-tp", "rollout: {tp_per_engine: 2}", [], None, "rollout.tp_per_engine", "2", "sglang"),
    ("bf16-sync-check", "model: {dtype: bfloat16}", [], None, "model.dtype", "'bfloat16'",
     "rollout.logprob_tolerance: 1.0"),
    ("sglang-on-cpu", "rollout: {backend: sglang}", [], None, "rollout.backend", "'sglang'", "device=cuda"),
    ("sglang-shard-sync-mixtral",
     "model: {config_path: model.json}\nrollout: {backend: sglang, weight_sync: shard}\n"
     "resources: {device: cuda}",
     [], lambda p: (p / "model.json").write_text(json.dumps(MIXTRAL)),
     "rollout.weight_sync", "'shard'", "model_type 'mixtral': hpcrl's loader writes qwen3_moe parameters only. "
     "Use rollout.weight_sync: broadcast"),
    # SGLang's Qwen3-MoE and Mixtral classes never tie lm_head: a tied model's head was never synced
    ("sglang-tied-qwen3-moe", "model: {config_path: model.json}\nrollout: {backend: sglang}\nresources: {device: cuda}",
     [], lambda p: (p / "model.json").write_text(json.dumps({**json.loads((CONFIG_DIR / "tiny-qwen3-moe.json")
                                                                          .read_text()), "tie_word_embeddings": True})),
     "model.config_path", "model.json'", "Qwen3MoeForCausalLM always builds an lm_head of its own"),
    ("verl-key-name", "algorithm: {learning_rate: 0.1}", [], None, "algorithm.learning_rate", "0.1",
     "(did you mean 'lr'?)"),
    ("verl-dynamic-bsz", "trainer: {use_dynamic_bsz: true}", [], None, "trainer.use_dynamic_bsz", "True",
     "(did you mean 'max_tokens_per_micro_batch'?)"),
    ("megatron-recompute", "trainer: {recompute_activations: true}", [], None, "trainer.recompute_activations",
     "True", "(did you mean 'recompute_granularity'?)"),
    ("checkpoint-dir-a-file", "checkpoint: {dir: job.yaml}", [], None, "checkpoint.dir", "job.yaml",
     "a directory path (not an existing file)"),
    ("dual-clip-c", "algorithm: {clip_ratio_c: 1.0}", [], None, "algorithm.clip_ratio_c", "1.0", "> 1, e.g. 3.0"),
    ("dual-clip-gspo", "algorithm: {name: gspo, clip_ratio_c: 3.0}", [], None, "algorithm.clip_ratio_c", "3.0",
     "gspo clips one ratio per sequence"),
    ("routing-replay-bad", "rollout: {routing_replay: r4}", [], None, "rollout.routing_replay", "'r4'",
     "none, observe, r3, r2"),
    ("async-negative", "rollout: {max_staleness: -1}", [], None, "rollout.max_staleness", "-1", ">= 0"),
    ("async-sft", "algorithm: {name: sft}\nrollout: {max_staleness: 1}", [], None, "rollout.max_staleness", "1",
     "sft trains on the data's answers"),
    ("async-temperature", "rollout: {max_staleness: 1, temperature: 0.7}", [], None, "rollout.max_staleness", "1",
     "set rollout.temperature: 1.0"),
    ("fp32-head-flag-without-key", "rollout: {server_args: [--enable-fp32-lm-head]}", [], None,
     "rollout.server_args[0]", "--enable-fp32-lm-head", "set rollout.fp32_lm_head: true"),
    ("async-rescore-sync", "rollout: {rescore_per_group: 2}", [], None, "rollout.rescore_per_group", "2",
     "applies to asynchronous runs"),
    ("async-rescore-range", "rollout: {max_staleness: 1, rescore_per_group: 0}", [], None,
     "rollout.rescore_per_group", "0", "must be in [1, algorithm.group_size="),
    ("async-partial-k1", "rollout: {max_staleness: 1, partial: true}", [], None, "rollout.partial", "True",
     "set rollout.max_staleness: 2"),
    # the sync check scored the batch again with the engines' new routes: a false failure at step 1
    ("async-r3", "rollout: {max_staleness: 1, routing_replay: r3}", [], None, "rollout.routing_replay", "'r3'",
     "Use r3 with max_staleness: 0"),
    # no push in a warmup step: the engines fell behind and take() re-sampled forever
    ("async-critic-warmup", "algorithm: {name: ppo}\nrollout: {max_staleness: 1}\ncritic: {warmup_steps: 2}", [],
     None, "critic.warmup_steps", "2", "set critic.warmup_steps: 0 or rollout.max_staleness: 0"),
    ("async-tis-cap-kept", "rollout: {max_staleness: 1}\nalgorithm: {tis_cap: 3.0, rollout_correction: mis}", [],
     None, "algorithm.tis_cap", "3.0", "rollout_correction: tis (this job has mis)"),
    ("config-size-a-string", "model: {config_path: model.json}", [], deepseek_json(hidden_size="64"),
     "model.config_path", "model.json", "hidden_size='64': expected a positive integer"),
    ("deepseek-n-group", "model: {config_path: model.json}", [],
     deepseek_json(n_group=3),
     "model.config_path", "model.json", "n_group=3: must divide n_routed_experts=8"),
    ("deepseek-topk-group", "model: {config_path: model.json}", [],
     deepseek_json(topk_group=5),
     "model.config_path", "model.json", "topk_group=5: must be between 1 and n_group=4"),
    ("deepseek-group-score", "model: {config_path: model.json}", [],
     deepseek_json(num_experts_per_tok=2),
     "model.config_path", "model.json", "num_experts_per_tok // topk_group must be 2"),
    ("routing-replay-dense-model", "model: {config_path: model.json}\nrollout: {routing_replay: r3}", [],
     deepseek_json(first_k_dense_replace=3),
     "rollout.routing_replay", "'r3'", "no MoE layer"),
    ("routing-replay-speculative", "rollout: {routing_replay: r3, server_args: [--speculative-algorithm=EAGLE]}",
     [], None, "rollout.server_args[0]", "'--speculative-algorithm=EAGLE'", "verify tokens"),
    ("sglang-shard-sync-deepseek",
     "model: {preset: tiny-deepseek-v3}\nrollout: {backend: sglang, weight_sync: shard}\nresources: {device: cuda}",
     [], None, "rollout.weight_sync", "'shard'", "w_kc/w_vc"),
    ("sglang-shard-sync-kimi-k2",  # DeepSeek-V3's reason, under Kimi-K2's model type
     "model: {config_path: model.json}\nrollout: {backend: sglang, weight_sync: shard}\nresources: {device: cuda}",
     [], deepseek_json(model_type="kimi_k2", n_group=1, topk_group=1), "rollout.weight_sync", "'shard'",
     "model_type 'kimi_k2': SGLang 0.5.23's DeepSeek load derives"),
    ("sglang-shard-sync-deepseek-v2",  # SGLang loads V2 and V3 with one DeepseekV2ForCausalLM
     "model: {config_path: model.json}\nrollout: {backend: sglang, weight_sync: shard}\nresources: {device: cuda}",
     [], lambda p: (p / "model.json").write_text(json.dumps(deepseek_v2_config())), "rollout.weight_sync",
     "'shard'", "model_type 'deepseek_v2': SGLang 0.5.23's DeepSeek load derives"),
    ("shard-sync-on-cuda", "rollout: {weight_sync: shard}\nresources: {device: cuda}", [], None,
     "rollout.weight_sync", "'shard'", "gloo on CPU tensors"),
    ("sglang-shard-quantized",
     "rollout: {backend: sglang, weight_sync: shard, server_args: [--quantization, fp8]}\n"
     "resources: {device: cuda}",
     [], None, "rollout.server_args[0]", "'--quantization'", "weight_sync: broadcast"),
    ("sglang-shard-moe-runner", "rollout: {backend: sglang, weight_sync: shard, server_args: "
     "['--moe-runner-backend=triton_kernel']}\nresources: {device: cuda}", [], None, "rollout.server_args[0]",
     "triton_kernel", "'triton_kernel' MoE runner"),
    ("sglang-tp-heads", "rollout: {backend: sglang, tp_per_engine: 3}\nresources: {device: cuda}", [], None,
     "rollout.tp_per_engine", "3", "valid tp_per_engine: 1, 2, 4"),
    ("gpus-on-cpu", "resources: {gpus_per_node: 4}", [], None, "resources.gpus_per_node", "4", "device=cuda"),
    ("too-few-gpus", "resources: {device: cuda, gpus_per_node: 2}\ntrainer: {num_procs: 4}", [], None,
     "trainer.num_procs", "4", "num_procs <= 2"),
    ("context-length", "rollout: {max_new_tokens: 100}", [], None, "rollout.max_new_tokens", "100",
     "max_new_tokens <= 55"),
    ("empty-run-dir", "logging: {run_dir: ''}", [], None, "logging.run_dir", "''", "null"),
    ("set-without-equals", "name: ok", ["algorithm.lr"], None, "--set", "'algorithm.lr'", "key=value"),
    ("set-unknown-key", "name: ok", ["algorithm.lrr=1"], None, "--set", "'algorithm.lrr=1'",
     "did you mean 'algorithm.lr'"),
    ("set-section", "name: ok", ["trainer=4"], None,
     "--set", "'trainer=4'", "is a section; set one of its keys"),
    ("set-unknown-section", "name: ok", ["trainr.tp=2"], None, "--set", "'trainr.tp=2'",
     "did you mean 'trainer.tp'"),
    ("set-bad-yaml", "name: ok", ["rollout.server_args=[a, b"], None, "--set", "'rollout.server_args=[a, b'",
     "not valid yaml"),
    ("set-bad-type", "name: ok", ["trainer.tp=two"], None,
     "trainer.tp", "'two'", "set by --set trainer.tp=two"),
    ("set-bad-range", "name: ok", ["algorithm.lr=-1e-3"], None, "algorithm.lr", "-0.001", "set by --set"),
    ("yaml-syntax", "name: ok\nalgorithm:\n  lr: [1e-3\n", [], None, "job", "job.yaml", "line 4"),
    ("top-level-list", "- model\n- data\n", [], None, "job", "job.yaml", "mapping"),
    ("empty-file", "# nothing\n", [], None, "job", "job.yaml", "empty"),
]


@pytest.mark.parametrize(("text", "overrides", "setup", "path", "shown", "hint"),
                         [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_input_names_key_value_and_fix(tmp_path, text, overrides, setup, path, shown, hint):
    if setup is not None:
        setup(tmp_path)
    job_file = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_job(job_file, overrides)
    message = str(info.value)
    assert info.value.path == path, message
    assert shown in message, message
    assert hint.lower() in message.lower(), message
    assert "\n" not in message


def test_sglang_engines_take_the_shard_route_for_qwen3_moe(tmp_path):
    job = load_job(write(tmp_path, "rollout: {backend: sglang, weight_sync: shard, tp_per_engine: 2}\n"
                                   "resources: {device: cuda}\n"))
    assert job.rollout.weight_sync == "shard"
    load_job(write(tmp_path, "rollout: {backend: sglang, weight_sync: shard, server_args: "
                             "[--moe-runner-backend, triton]}\nresources: {device: cuda}\n"))
    load_job(write(tmp_path, "rollout: {backend: sglang, server_args: [--quantization, fp8]}\n"  # broadcast
                             "resources: {device: cuda}\n"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_job(tmp_path / "absent.yaml")
    message = str(info.value)
    assert info.value.path == "job" and "absent.yaml" in message and "does not exist" in message


def test_defaults_from_a_minimal_file(tmp_path):
    job = load_job(write(tmp_path, "name: tiny\n"))
    expected = JobConfig(name="tiny", base_dir=str(tmp_path.resolve()))
    assert job == expected
    assert job.world_size == 3
    validate(job)  # idempotent, does not modify the job
    assert job == expected


def test_types_floats_and_null_sections(tmp_path):
    job = load_job(write(tmp_path, """
        model:
        algorithm: {lr: 1e-3, kl_coef: 1, adam_eps: '1e-6'}
        rollout: {server_args: [--foo, bar]}
    """))
    assert job.algorithm.lr == 1e-3 and type(job.algorithm.lr) is float
    assert job.algorithm.kl_coef == 1.0 and type(job.algorithm.kl_coef) is float
    assert job.algorithm.adam_eps == 1e-6
    assert job.model.preset == "tiny-qwen3-moe"
    assert job.rollout.server_args == ["--foo", "bar"]


def test_overrides(tmp_path):
    job_file = write(tmp_path, "name: base\ntrainer: {num_procs: 1}\n")
    job = load_job(job_file, ["algorithm.lr=3e-4", "trainer.num_procs=4", "trainer.ep=4", "name=other",
                              "rollout.server_args=[--a, '1']", "checkpoint.dir=null",
                              "logging.progress=false", "trainer.tp=2"])
    assert job.algorithm.lr == 3e-4
    assert (job.trainer.num_procs, job.trainer.ep, job.trainer.tp) == (4, 4, 2)
    assert job.name == "other"
    assert job.rollout.server_args == ["--a", "1"]
    assert job.checkpoint.dir is None and job.logging.progress is False


def test_later_override_wins_and_value_may_contain_equals(tmp_path):
    job = load_job(write(tmp_path, "name: x\n"), ["name=a", "name=b", "rollout.server_args=[--k=v]"])
    assert job.name == "b" and job.rollout.server_args == ["--k=v"]


def test_relative_paths_resolve_against_the_job_file(tmp_path, monkeypatch):
    base = tmp_path.resolve()
    (base / "cfg").mkdir()
    (base / "cfg" / "model.json").write_text(json.dumps(MID_MODEL))
    (base / "data").mkdir()
    (base / "data" / "train.jsonl").write_text('{"q": "ab>", "a": "ba"}\n')
    job_file = write(base, """
        model: {config_path: ../cfg/model.json}
        data: {path: ../data/train.jsonl, prompt_key: q, answer_key: a}
        checkpoint: {dir: ckpt}
        logging: {run_dir: runs/r1}
    """, name="jobs/job.yaml")
    monkeypatch.chdir(base / "data")  # the working directory must not matter
    job = load_job(job_file)
    assert job.base_dir == str(base / "jobs")
    assert job.model.config_path == str(base / "cfg" / "model.json")
    assert job.data.path == str(base / "data" / "train.jsonl")
    assert job.checkpoint.dir == str(base / "jobs" / "ckpt")
    assert job.logging.run_dir == str(base / "jobs" / "runs" / "r1")
    relative = load_job(Path("..", "jobs", "job.yaml"))  # a relative job path resolves from the cwd
    assert relative == job


def test_round_trip_through_yaml_json_and_dict(tmp_path):
    (tmp_path / "model.json").write_text(json.dumps(MID_MODEL))
    job = load_job(write(tmp_path, """
        name: rt
        model: {config_path: model.json}
        algorithm: {lr: 1e-5, adam_eps: 1e-8, norm_adv_by_std: false}
        trainer: {tp: 2, ep: 4, num_procs: 4}
        rollout: {server_args: [--x], temperature: 0.7}
    """))
    d = to_dict(job)
    assert "base_dir" not in d
    assert set(d) == {f.name for f in dataclasses.fields(JobConfig)} - {"base_dir"}
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_text(yaml.safe_dump(d, sort_keys=False))
    again = load_job(elsewhere / "config.yaml")
    assert dataclasses.replace(again, base_dir=job.base_dir) == job
    from_json = job_from_dict(json.loads(json.dumps(d)), base_dir=elsewhere)
    assert dataclasses.replace(from_json, base_dir=job.base_dir) == job
    assert from_json.base_dir == str(elsewhere)


def test_cuda_layout_validates_without_a_gpu(tmp_path):
    model_file(tmp_path)
    job = load_job(write(tmp_path, """
        model: {config_path: model.json, dtype: bfloat16}
        trainer: {tp: 2, pp: 2, ep: 4, etp: 1, num_procs: 8}
        rollout: {backend: sglang, num_engines: 2, tp_per_engine: 4, logprob_tolerance: 1.0,
                  logprob_mean_tolerance: 0.02}
        resources: {device: cuda, nodes: 2, gpus_per_node: 4, rollout_nodes: 2}
    """))
    assert job.world_size == 1 + 8 + 2


def test_every_schema_key_is_documented_with_its_default():
    docs = (REPO / "docs" / "config.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z0-9_.]+)` \| `([^`]*)` \|", docs, flags=re.MULTILINE))
    assert list(rows) == valid_keys(), "docs/config.md keys differ from the schema (order matters too)"
    def schema_default(cls, leaf):  # the field's own default: null for the algorithm's own keys
        f = next(f for f in dataclasses.fields(cls) if f.name == leaf)
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()

    for key in valid_keys():
        section, _, leaf = key.rpartition(".")
        default = schema_default(type(getattr(JobConfig(), section)), leaf) if section else \
            schema_default(JobConfig, leaf)
        documented = yaml.safe_load(rows[key])
        if isinstance(default, float):
            documented = float(documented)
        assert documented == default, f"docs/config.md: {key} default {rows[key]!r}, schema {default!r}"


def test_schema_field_types_are_supported_by_the_loader():
    # A field of a new type needs a new branch in load._coerce; this makes that impossible to miss.
    for section in dataclasses.fields(JobConfig):
        tp = typing.get_type_hints(JobConfig)[section.name]
        if not dataclasses.is_dataclass(tp):
            continue
        for f in dataclasses.fields(tp):
            hint = typing.get_type_hints(tp)[f.name]
            assert hint in (int, float, bool, str, str | None, float | None, list[str], list[int], dict[str, Any]), \
                f"{section.name}.{f.name}: {hint}"


def test_sync_checksum_choices_are_the_runtimes_modes():
    """validate.py is torch-free, so it lists the modes itself; they must be moe's."""
    from hpcrl.config.validate import SYNC_CHECKSUMS
    from moe.runtime import VERIFY_MODES

    assert SYNC_CHECKSUMS == VERIFY_MODES


def test_the_greedy_threshold_is_the_reference_engines():
    """validate.py is torch-free, so it states SGLang's greedy threshold itself; it must be the engine's."""
    from hpcrl.config.validate import SGLANG_GREEDY_BELOW
    from hpcrl.rollout.engine import SAMPLING_EPS

    assert SGLANG_GREEDY_BELOW == SAMPLING_EPS


def test_dict_fields_take_mappings_with_string_keys():
    job = job_from_dict({"data": {"chat_template_kwargs": {"enable_thinking": False}}})
    assert job.data.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="data.chat_template_kwargs.*expected a mapping"):
        job_from_dict({"data": {"chat_template_kwargs": ["enable_thinking"]}})
    with pytest.raises(ConfigError, match="key 1 is not a string"):
        job_from_dict({"data": {"chat_template_kwargs": {1: True}}})


def test_eval_needs_val_path_and_sampling_for_several_samples(tmp_path):
    from hpcrl.config.validate import validate

    job = job_from_dict({"eval": {"interval_steps": 5}})
    with pytest.raises(ConfigError, match=r"eval.interval_steps=5: evaluation needs held-out prompts"):
        validate(job)
    job = job_from_dict({"eval": {"before_train": True}})
    with pytest.raises(ConfigError, match=r"eval.before_train=True: evaluation needs held-out prompts: set "
                                          r"data.val_path, or eval.before_train: false"):
        validate(job)
    val = tmp_path / "val.jsonl"
    val.write_text('{"prompt": "a", "answer": "aaaa"}\n')
    validate(job_from_dict({"data": {"val_path": str(val)}, "eval": {"before_train": True}}))  # no interval
    job = job_from_dict({"data": {"val_path": str(val)}, "eval": {"interval_steps": 5, "num_samples": 4}})
    with pytest.raises(ConfigError, match=r"eval.num_samples=4: greedy samples"):
        validate(job)
    job.eval.temperature = 1.0
    validate(job)
    job.eval.temperature = 1e-7  # SGLang decodes greedily below 1e-6: pass@4 was a greedy pass@1
    with pytest.raises(ConfigError, match=r"eval.temperature=1e-07: must be 0 \(greedy\) or >= 1e-06"):
        validate(job)


def test_async_run_corrects_with_tis_and_takes_its_cap():
    """rollout.max_staleness >= 1 with algorithm.rollout_correction none: the loss applies tis
    (decoupled PPO's behaviour weight), so tis_cap is read and allowed; synchronously it is not."""
    from hpcrl.config.schema import rollout_correction

    job = job_from_dict({"rollout": {"max_staleness": 1}, "algorithm": {"tis_cap": 3.0}})
    validate(job)
    assert rollout_correction(job) == "tis" and job.algorithm.rollout_correction == "none"
    sync = job_from_dict({"algorithm": {"tis_cap": 3.0}})
    with pytest.raises(ConfigError, match="tis_cap"):
        validate(sync)
    assert rollout_correction(sync) == "none"


def test_wandb_logging_needs_the_wandb_package(monkeypatch):
    import importlib.util

    from hpcrl.config.validate import validate

    for bad in ("", "team/project", "a:b", "x" * 129):  # wandb.init refuses them after the start-up
        with pytest.raises(ConfigError, match=r"logging.wandb_project=.*: must be a W&B project name \(at most 128 "
                                              r"characters, none of / \\ # \? % :\), or null for no W&B"):
            validate(job_from_dict({"logging": {"wandb_project": bad}}))
    job = job_from_dict({"logging": {"wandb_project": "my-project"}})
    validate(job)  # the test extras install wandb
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"logging.wandb_project='my-project': W&B logging needs the wandb package "
                                          r"in hpcrl's environment: `bash install.sh --wandb`"):
        validate(job)


def test_profile_steps_are_steps_of_the_run_each_once():
    validate(job_from_dict({"algorithm": {"num_steps": 4}, "logging": {"profile_steps": [0, 3]}}))
    for steps, where, why in [([4], 0, r"a step of the run, in \[0, algorithm.num_steps=4\): the first step is 0"),
                              ([1, -1], 1, r"a step of the run"),
                              ([2, 2], 1, r"each step once: remove the repeat")]:
        with pytest.raises(ConfigError, match=rf"logging.profile_steps\[{where}\]=.*: {why}"):
            validate(job_from_dict({"algorithm": {"num_steps": 4}, "logging": {"profile_steps": steps}}))
    with pytest.raises(ConfigError, match=r"logging.profile_steps\[0\]='1': expected an integer"):
        job_from_dict({"logging": {"profile_steps": ["1"]}})


def test_recompute_settings_megatron_can_take_for_the_model():
    """trainer.recompute_*: the choices, Megatron's layer split (uniform chunks divide each pipeline
    stage, which it otherwise indexes past), and no module that would recompute nothing in the model."""
    qwen = {"trainer": {"recompute_granularity": "full"}}  # tiny-qwen3-moe: 2 MoE layers
    validate(job_from_dict(qwen))
    deepseek = {"model": {"preset": "tiny-deepseek-v3"}}  # MLA, 1 dense + 2 MoE layers, a shared expert
    validate(job_from_dict({**deepseek, "trainer": {"recompute_granularity": "selective", "recompute_modules": [
        "core_attn", "layernorm", "shared_experts", "mlp", "mla_up_proj"]}}))
    validate(job_from_dict({**deepseek, "trainer": {"recompute_granularity": "full", "recompute_num_layers": 3}}))
    for trainer, where, why in [
        ({"recompute_granularity": "ful"}, "recompute_granularity='ful'", r"must be one of: none, full, selective"),
        ({"recompute_granularity": "full", "recompute_method": "blocks"}, "recompute_method='blocks'",
         r"must be one of: uniform, block"),
        ({"recompute_granularity": "full", "recompute_num_layers": 0}, "recompute_num_layers=0", r"must be >= 1"),
        ({"recompute_granularity": "full", "recompute_num_layers": 3}, "recompute_num_layers=3",
         r"each pipeline stage's layers \[2\] in chunks of recompute_num_layers, which must divide each: use one "
         r"of \[1, 2\], or recompute_method: block"),
        ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
         "recompute_num_layers=3", r"the stages have \[2\] layers: use 1..2"),
        ({"recompute_granularity": "selective", "recompute_modules": []}, "recompute_modules=\\[\\]",
         r"name at least one of core_attn, layernorm"),
        ({"recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe_act"]},
         r"recompute_modules\[1\]='moe_act'", r"grouped-GEMM experts only.*use moe"),
        ({"recompute_granularity": "selective", "recompute_modules": ["attn"]}, r"recompute_modules\[0\]='attn'",
         r"must be one of: core_attn, layernorm, moe, shared_experts, mlp, mla_up_proj"),
        ({"recompute_granularity": "selective", "recompute_modules": ["moe", "moe"]}, r"recompute_modules\[1\]='moe'",
         r"each module once"),
        ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, r"recompute_modules\[0\]='mlp'",
         r"preset 'tiny-qwen3-moe' has no dense MLP layer \(every layer is MoE: use moe\), so it would recompute "
         r"nothing; remove it"),
        ({"recompute_granularity": "selective", "recompute_modules": ["mla_up_proj"]},
         r"recompute_modules\[0\]='mla_up_proj'", r"has no multi-latent attention"),
        ({"recompute_granularity": "selective", "recompute_modules": ["shared_experts"]},
         r"recompute_modules\[0\]='shared_experts'", r"has no shared experts"),
        ({"recompute_granularity": "selective", "recompute_modules": ["moe", "shared_experts"]},
         r"recompute_modules\[1\]='shared_experts'", r"moe recomputes the whole MoE layer.*list one of them"),
        ({"recompute_method": "block"}, "recompute_method='block'",
         r"applies with trainer.recompute_granularity: full only \(it is none\): set that, or drop recompute_method"),
        ({"recompute_granularity": "selective", "recompute_num_layers": 2}, "recompute_num_layers=2",
         r"applies with trainer.recompute_granularity: full only \(it is selective\)"),
        ({"recompute_granularity": "full", "recompute_modules": ["moe"]}, r"recompute_modules=\['moe'\]",
         r"applies with trainer.recompute_granularity: selective only"),
    ]:
        with pytest.raises(ConfigError, match=rf"trainer.{where}: .*{why}"):
            validate(job_from_dict({"trainer": trainer}))
    # PP2 of DeepSeek's 3 layers as 2 + 1: chunks of 2 do not divide the last stage
    with pytest.raises(ConfigError, match=r"stage's layers \[2, 1\] in chunks.*use one of \[1\]"):
        validate(job_from_dict({**deepseek, "trainer": {"pp": 2, "num_procs": 2, "first_stage_layers": 2,
                                                        "recompute_granularity": "full", "recompute_num_layers": 2}}))


def test_micro_batches_by_tokens_hold_the_longest_sequence():
    """trainer.max_tokens_per_micro_batch: >= 0; when set, at least the longest sequence a step can have
    (the copy task's 2-token prompts + max_new_tokens 4 = 6 tokens, padded to a multiple of tp), and
    the alltoall dispatcher where micro-batches of other shapes meet (EP, PP)."""
    validate(job_from_dict({"rollout": {"max_new_tokens": 4}, "trainer": {"max_tokens_per_micro_batch": 6}}))
    for extra, n, why in [
        ({}, -1, r"must be >= 0 \(0: micro-batches of trainer.micro_batch_size sequences\)"),
        ({}, 5, r"data.task=copy's 2-token prompts \+ rollout.max_new_tokens=4 make sequences of up to 6 "
                r"tokens; use at least 6, or 0"),
        ({"tp": 2, "etp": 2, "num_procs": 2, "dispatcher": "allgather"}, 5,
         r"prompts \+ rollout.max_new_tokens=4, padded to a multiple of trainer.tp=2, make sequences of up to 6"),
        ({"tp": 2, "etp": 2, "num_procs": 2, "dispatcher": "allgather", "max_new_tokens": 5}, 6,
         r".*up to 8 tokens"),
        ({"ep": 2, "num_procs": 2, "dispatcher": "allgather"}, 64, r"allgather dispatcher cannot gather.*"
                                                                    r"set trainer.dispatcher: alltoall, or 0"),
    ]:
        new = extra.pop("max_new_tokens", 4)
        job = {"rollout": {"max_new_tokens": new}, "trainer": {"max_tokens_per_micro_batch": n, **extra}}
        with pytest.raises(ConfigError, match=rf"trainer.max_tokens_per_micro_batch={n}: .*{why}"):
            validate(job_from_dict(job))


def test_sft_micro_batches_by_tokens_hold_the_demonstrations():
    """sft trains on the data's answers, not on rollout.max_new_tokens of generation: the copy task's
    4-token answers and their end make 2 + 5 = 7 tokens."""
    sft = {"algorithm": {"name": "sft"}, "rollout": {"max_new_tokens": 1}}
    validate(job_from_dict({**sft, "trainer": {"max_tokens_per_micro_batch": 7}}))
    with pytest.raises(ConfigError, match=r"trainer.max_tokens_per_micro_batch=6: data.task=copy's 2-token prompts "
                                          r"\+ 5-token answers make sequences of up to 7 tokens"):
        validate(job_from_dict({**sft, "trainer": {"max_tokens_per_micro_batch": 6}}))
