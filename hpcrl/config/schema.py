"""Typed schema of a job file: one dataclass per YAML section, `JobConfig` at the top.

Every field maps 1:1 to a YAML key (`algorithm.group_size` is `JobConfig.algorithm.group_size`).
The dataclasses hold values; `AlgorithmConfig` also gives the keys whose default belongs to the
algorithm their values when it is built (`resolve_algorithm_defaults`). `hpcrl.config.load` parses
YAML into them and `hpcrl.config.validate` checks single fields and cross-field constraints with
messages that name the YAML path, the bad value and the valid choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcrl.dataflows._declared import declared as declared_defaults


@dataclass(kw_only=True)
class ModelConfig:
    path: str | None = None
    """A local HuggingFace model directory (config.json, *.safetensors with their index, tokenizer
    files, optional generation_config.json); policy, reference model and engines start from its
    weights. Wins over `config_path` and `preset`. Relative to the job file."""
    preset: str | None = "tiny-qwen3-moe"
    """Built-in tiny model (see hpcrl/models/presets.py), used when `path` and `config_path` are null;
    random init from `trainer.seed`."""
    config_path: str | None = None
    """Path to a HuggingFace config.json (Qwen3-MoE, Mixtral) for a random-init model; relative to
    the job file."""
    random_init: str = "auto"
    """How a model without weights (preset / config_path) is initialised: hf (transformers' own init
    drawn on one rank; debug sizes only, up to HF_INIT_MAX_PARAMS) | sharded (every rank draws only its
    slices from a counter-based generator keyed by tensor name and element index) | auto (hf up to
    HF_INIT_MAX_PARAMS, sharded above). Both are the same under every trainer layout."""
    dtype: str = "float32"
    """Parameter dtype: float32 | bfloat16 (bf16 params, fp32 main params in Megatron's
    distributed optimizer; runs on CPU too, but GPUs are where it pays)."""
    trust_remote_code: bool = False
    """Run the Python code `path` ships for its tokenizer (tokenizer_config.json's auto_map, e.g.
    Kimi-K2's tiktoken tokenizer), as transformers' trust_remote_code. Off: such a tokenizer is refused."""


@dataclass(kw_only=True)
class DataConfig:
    task: str | None = "copy"
    """Built-in synthetic task (see hpcrl/tasks/synthetic.py), used when `path` is null."""
    path: str | None = None
    """A .jsonl or .parquet file of prompts and answers (relative to the job file); wins over `task`."""
    prompt_key: str = "prompt"
    """Column (JSON key) of the prompt text in `path`."""
    answer_key: str = "answer"
    """Column of the reference answer in `path`, passed to the reward; a dotted key reaches into
    nested columns (verl's files: `reward_model.ground_truth`)."""
    apply_chat_template: bool = True
    """Render message-list prompts ([{role, content}, ...]) with the tokenizer's chat template
    (add_generation_prompt). Message lists need it; false is for files of plain-string prompts
    that must go to the tokenizer as they are."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the chat template, e.g. {enable_thinking: false} for Qwen3."""
    max_prompt_tokens: int = 0
    """Longest prompt in tokens (after the chat template); 0: only the model's context limits it."""
    overlong_prompts: str = "error"
    """error (validation names the file and row) | drop (rows over max_prompt_tokens are skipped;
    the run prints how many)."""
    val_path: str | None = None
    """A held-out .jsonl/.parquet file in the same format as `path`, for evaluation (see `eval`)."""
    num_prompts_per_step: int = 8
    """Distinct prompts per step; each is sampled `algorithm.group_size` times."""
    seed: int = 0
    """Seed of the prompt sampler (shuffle order)."""


@dataclass(kw_only=True)
class AlgorithmConfig:
    name: str = "grpo"
    """RL algorithm: grpo | dr_grpo | rloo | reinforce_pp | gspo | dapo | ppo | sft (hpcrl/dataflows/), or
    the import path of a module defining `step(rl, step)` over hpcrl/controller/api.py."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are normalised within a group."""
    clip_eps: float | None = None
    """Lower clip of the importance ratio: [1 - clip_eps, 1 + clip_eps_high]. null: the algorithm's
    default (gspo 3e-4, the other clipping algorithms 0.2); sft has no ratio to clip."""
    clip_eps_high: float | None = None
    """Upper clip of the ratio (DAPO's clip-higher when above clip_eps). null: the algorithm's default
    (gspo 4e-4, dapo 0.28), else clip_eps; 0 means clip_eps too."""
    clip_ratio_c: float | None = None
    """Dual-clip PPO's c (Ye et al. 2020, arXiv 1912.09729; verl's clip_ratio_c, 3.0 there): a token
    with a negative advantage loses at most -c * A, however far its ratio has grown. > 1; null: off.
    The token-ratio losses read it (grpo, dr_grpo, rloo, dapo, reinforce_pp, ppo)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (initial) policy; 0 disables the reference pass."""
    kl_estimator: str | None = None
    """k1 | k2 | k3 (Schulman's estimators) of the KL to the reference: a loss term in grpo, dr_grpo,
    rloo (default k3, the low-variance one), in the reward in ppo and reinforce_pp (default k1).
    null: the algorithm's default; gspo, dapo and sft have no KL term."""
    loss_agg: str | None = None
    """token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm (Dr. GRPO: each
    sequence's token sum divided by the constant `loss_agg_norm`). null: the algorithm's default
    (token-mean; fixed by gspo: seq-mean-token-mean, dr_grpo: seq-mean-token-sum-norm, sft)."""
    loss_agg_norm: float = 0.0
    """The constant of seq-mean-token-sum-norm; 0 means rollout.max_new_tokens (Dr. GRPO's choice)."""
    norm_adv_by_std: bool = True
    """Divide group-centred rewards by the group's std (GRPO); false gives Dr. GRPO's advantages."""
    ppo_epochs: int = 1
    """Passes over each rollout batch (PPO-style updates); > 1 computes the old log-probs once first,
    so the ratio moves and the clip acts."""
    mini_batch_size: int = 0
    """Rows (completions) per optimizer step; 0: the whole batch (num_prompts_per_step * group_size).
    Must divide the batch and be a multiple of the data-parallel size."""
    max_generation_rounds: int = 3
    """dapo: generation rounds per step at most to fill the batch with groups whose rewards differ
    (dynamic sampling); still short after them, the batch is topped up with dropped groups (zero
    advantage: no gradient) and dynamic_sampling/groups_padded says how many."""
    overlong_buffer_len: int = 0
    """dapo: soft overlong punishment over the last N tokens before rollout.max_new_tokens (a penalty
    growing linearly to overlong_penalty_factor); 0 disables it."""
    overlong_penalty_factor: float = 1.0
    """dapo: the largest overlong penalty, subtracted from the reward at max_new_tokens."""
    rollout_correction: str = "none"
    """none | tis | mis: correct for the engines' sampling distribution (behaviour policy) differing
    from the trainer's (bf16 engines, other kernels). tis: token-level truncated importance weights
    min(pi_old / pi_engine, tis_cap) on the policy-gradient term; mis: rejection, the sequences (or
    tokens, mis_level) whose importance ratio leaves [mis_low, mis_high] leave the loss and its
    token and sequence counts. Metrics train/mismatch_* either way."""
    tis_cap: float = 2.0
    """tis: the truncation of the per-token importance weights."""
    mis_low: float = 0.5
    """mis: sequences (tokens) whose ratio pi_old / pi_engine is below this are rejected."""
    mis_high: float = 2.0
    """mis: sequences (tokens) whose ratio is above this are rejected."""
    mis_level: str = "sequence"
    """mis: the ratio tested: sequence (the product over the response's tokens) | geometric (its
    geometric mean) | token (each token's own ratio; only the tokens outside the band leave)."""
    lr: float = 1e-3
    """Optimizer (Adam) learning rate: the peak of lr_schedule."""
    lr_schedule: str = "constant"
    """constant | linear | cosine: Megatron-core's lr decay style over the run's RL steps, from lr
    after the warmup down to min_lr_ratio * lr at algorithm.num_steps (the critic's the same, with
    its own lr as the peak)."""
    lr_warmup_steps: int = 0
    """RL steps of linear warmup from 0 to lr (Megatron's: step 0 runs at lr 0), then lr_schedule."""
    min_lr_ratio: float = 0.0
    """linear and cosine: the lr the decay ends at, as a fraction of lr."""
    weight_decay: float = 0.0
    """Optimizer weight decay (0 disables)."""
    adam_beta1: float = 0.9
    """Adam beta1, in [0, 1)."""
    adam_beta2: float = 0.999
    """Adam beta2, in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 0.0
    """Global grad-norm clip; 0 disables."""
    entropy_coef: float = 0.0
    """Entropy bonus of the policy loss: loss - entropy_coef * (the token-mean entropy of the response
    tokens under the current weights), as verl's actor.entropy_coeff; 0 disables it (the entropy is
    then only a metric, train/entropy). Keeps exploration up where a loss would collapse it early."""
    aux_loss_coef: float | None = None
    """MoE load-balancing loss coefficient (Megatron moe_aux_loss_coeff, the batch-wise loss); null:
    the model's own (hpcrl/trainer/model.py `aux_loss_coef_of`): Qwen3-MoE's and Mixtral's
    router_aux_loss_coef (transformers' default 0.001 where config.json leaves it out), 0 for
    DeepSeek-V3, which balances with its score-correction bias, and for DeepSeek-V2 (its sequence-wise
    aux_loss_alpha is not built)."""
    num_steps: int = 40
    """RL steps (generate -> reward -> update -> weight sync) of the run."""
    gamma: float = 1.0
    """ppo: discount of GAE over response tokens (1.0: the usual choice for LLMs, as in verl)."""
    lam: float = 1.0
    """ppo: GAE's lambda, in [0, 1] (1: Monte-Carlo returns minus the value; 0: one-step TD)."""
    kl_target: float = 0.0
    """ppo: target KL per sequence of the adaptive KL controller (Ziegler et al. 2019); 0 keeps
    algorithm.kl_coef fixed."""
    kl_horizon: float = 10000.0
    """ppo: horizon (in samples) of the adaptive KL controller."""

    def __post_init__(self) -> None:
        resolve_algorithm_defaults(self)


def resolve_algorithm_defaults(a: AlgorithmConfig) -> None:
    """Give the unset (None) keys of PER_ALGORITHM_KEYS the values algorithm `a.name` declares
    (hpcrl/dataflows/_declared.py), in place; keys the algorithm does not read stay as they are
    (None unless the job set them, which validation refuses). Idempotent: a resolved config (the
    run dir's config.json) resolves to itself."""
    defaults, _ = declared_defaults(a.name)
    for key in ("clip_eps", "kl_estimator", "loss_agg"):
        if getattr(a, key) is None and key in defaults:
            setattr(a, key, defaults[key])
    if "clip_eps" in defaults and a.clip_eps is not None:
        if a.clip_eps_high is None:
            a.clip_eps_high = defaults.get("clip_eps_high", a.clip_eps)
        elif a.clip_eps_high == 0:  # the spelling of "symmetric" before per-algorithm defaults
            a.clip_eps_high = a.clip_eps


@dataclass(kw_only=True)
class CriticConfig:
    enabled: bool = False
    """Build the critic for an algorithm other than ppo (a user's module calling rl.values and
    rl.update_critic); ppo always builds it. It lives on the trainer ranks with the policy's layout."""
    path: str | None = None
    """A HF model directory of the policy's architecture whose weights start the critic's body (e.g.
    an SFT export; its lm_head is not used, the value head starts fresh), or a one-label reward model
    of that architecture (transformers' ...ForSequenceClassification: `score.weight` [1, hidden]),
    whose score head starts the value head. null: the policy's weights."""
    lr: float = 0.0
    """The critic's Adam learning rate; 0 means algorithm.lr (Adam's betas and eps are the policy's)."""
    weight_decay: float = 0.0
    """The critic's weight decay."""
    grad_clip: float = 0.0
    """The critic's global grad-norm clip; 0 disables."""
    value_clip: float = 0.2
    """PPO2 value clipping: V may move at most this far from its rollout-time value per batch
    before its error stops counting; 0 disables (plain squared error)."""
    warmup_steps: int = 0
    """The first N steps train only the critic (the policy and the engines stay as they are)."""


@dataclass(kw_only=True)
class TrainerConfig:
    tp: int = 1
    """Tensor parallel size (Megatron tensor_model_parallel_size) of the dense layers and attention."""
    pp: int = 1
    """Pipeline parallel size; must divide the number of layers."""
    ep: int = 1
    """Expert parallel size; must divide the number of experts."""
    etp: int = 1
    """Expert tensor parallel size (Megatron expert_tensor_parallel_size)."""
    cp: int = 1
    """Context parallel size (Megatron context_parallel_size); `hpcrl plan` only, runs need 1."""
    first_stage_layers: int = 0
    """Decoder layers of the first pipeline stage (Megatron num_layers_in_first_pipeline_stage);
    0 splits the layers evenly."""
    last_stage_layers: int = 0
    """Decoder layers of the last pipeline stage (Megatron num_layers_in_last_pipeline_stage);
    0 splits the layers evenly."""
    num_procs: int = 1
    """Trainer ranks; data parallel size = num_procs / (tp * cp * pp)."""
    micro_batch_size: int = 64
    """Sequences per micro-batch (gradient accumulation over micro-batches); with
    max_tokens_per_micro_batch, the most sequences a micro-batch may hold."""
    logprob_micro_batch_size: int = 0
    """Sequences per micro-batch of the forwards without a backward (the old and reference log-probs,
    r2's recording forward, the critic's values); 0: micro_batch_size. They keep no activations, so
    larger micro-batches run them faster on GPUs (verl's log_prob_micro_batch_size_per_gpu). With
    max_tokens_per_micro_batch, the most sequences such a micro-batch may hold, under the same budget."""
    max_tokens_per_micro_batch: int = 0
    """0: micro-batches of micro_batch_size sequences, each padded to the batch's longest. N > 0: each
    DP rank fills micro-batches with its sequences, longest first, each padded only to its own longest
    and holding at most N tokens with that padding (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu,
    slime's --max-tokens-per-gpu); hpcrl/trainer/micro_batches.py."""
    dispatcher: str = "alltoall"
    """MoE token dispatcher: alltoall | allgather."""
    recompute_granularity: str = "none"
    """Activation recomputation in training forwards (Megatron recompute_granularity): none | full
    (each chunk of `recompute_num_layers` decoder layers keeps only its input and is computed again
    in the backward) | selective (the `recompute_modules` parts of each layer). Trades compute for
    activation memory; the step is the same, bit for bit, but for the norms' recompute, which sums
    one gradient in another order (docs/config.md)."""
    recompute_method: str = "uniform"
    """With recompute_granularity full (Megatron recompute_method): uniform (every stage's layers in
    chunks of recompute_num_layers, each recomputed) | block (the first recompute_num_layers layers of
    each pipeline stage recomputed, the rest kept)."""
    recompute_num_layers: int = 1
    """With recompute_granularity full: layers per recomputed chunk (uniform; must divide each
    pipeline stage's layers) or layers recomputed per stage (block)."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """With recompute_granularity selective (Megatron recompute_modules): any of core_attn, layernorm,
    moe, shared_experts (models with shared experts), mlp (dense MLP layers), mla_up_proj (MLA models)."""
    seed: int = 1234
    """Seed of the weight init, dropout and the rollout sampler."""
    deterministic: bool = True
    """On a GPU, the trainer ranks run torch's deterministic kernels (warn-only) with cuBLAS's fixed
    workspace, so reruns and resumes are bit-identical; false trades that for faster kernels (e.g.
    Megatron's scatter_add expert combine). CPU runs are deterministic either way."""


@dataclass(kw_only=True)
class RolloutConfig:
    backend: str = "reference"
    """reference (hpcrl's SGLang-protocol engine, CPU or GPU) | sglang (a real SGLang 0.5.x server)."""
    num_engines: int = 1
    """Rollout engines (servers); each holds a full copy of the policy, one MPI rank each."""
    tp_per_engine: int = 1
    """Tensor parallel size inside one engine (sglang only; the reference engine needs 1)."""
    nodes_per_engine: int = 1
    """Nodes one engine spans (SGLang's --nnodes): an engine too large for one node (DeepSeek-V3 in
    bf16) runs as one rollout rank per node, the first serving HTTP, the others SGLang's followers
    (--node-rank, --dist-init-addr); tp_per_engine / nodes_per_engine GPUs on each. The broadcast
    weight route only; the reference engine computes on its first node (docs/sglang.md)."""
    ep: int = 1
    """Expert parallel size inside one engine (SGLang --ep-size, which hpcrl passes); divides
    tp_per_engine and the experts. SGLang engines on the broadcast route."""
    dp_attention: int = 1
    """Data-parallel attention groups inside one engine (SGLang --attn-dp-size, its spelling of
    --dp-size with --enable-dp-attention, which hpcrl passes); divides tp_per_engine. SGLang engines
    on the broadcast route."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]; 1 samples from the full distribution."""
    max_new_tokens: int = 8
    """Tokens generated per completion at most; prompt + completion must fit the model's context."""
    ignore_eos: bool = False
    """Keep generating past <eos> up to max_new_tokens (SGLang's `ignore_eos`; fixed-length benchmarks)."""
    server_args: list[str] = field(default_factory=list)
    """Extra command-line arguments passed unchanged to the engine server (e.g. sglang flags)."""
    python: str | None = None
    """Python interpreter of the SGLang engines (backend sglang): one with SGLang 0.5.x and its own
    torch (docs/sglang_install.md); null means the interpreter of the rollout rank."""
    env_setup: list[str] = field(default_factory=list)
    """Shell lines run (bash) before each SGLang engine starts, unchanged: module loads, venv activation."""
    dtype: str = "auto"
    """Weights of the engines: auto (model.dtype) | float32 | bfloat16. A bfloat16 reference engine
    runs on CPU too: a real engine/trainer mismatch for rollout correction and the bf16 sync check."""
    logprob_tolerance: float = 1e-4
    """Max |engine log-prob - trainer log-prob| after a weight sync; larger stops the run."""
    logprob_mean_tolerance: float = 0.0
    """Mean |engine log-prob - trainer log-prob| over a step's response tokens; larger stops the run.
    0 disables it. The check for bf16 engines: rounding moves single tokens, a wrong weight all."""
    bucket_mb: int = 64
    """Weight-sync bucket size (flattened-bucket broadcast) and, for shard sync, the per-round staging
    budget of each rank."""
    routing_replay: str = "none"
    """none | observe | r3 | r2. observe: the engines return the experts they routed every token to
    (SGLang's --enable-return-routed-experts, which hpcrl adds) and each step logs
    mismatch/router_agreement, the share of (token, MoE layer) routes the trainer's training forward
    chose as the engine did. r3: the same, and the policy's old-log-prob and training forwards route
    each token to the engine's experts (megatron-core's RouterReplay; hpcrl/trainer/routing_replay.py).
    r2: the training forwards replay the routes of the trainer's own old-log-prob forward (only where
    one runs: ppo_epochs > 1 or mini-batches); the engines return none."""
    fp32_lm_head: bool = False
    """Compute the engines' LM head (the logits) in float32 from bf16 hidden states (SGLang's
    --enable-fp32-lm-head, which hpcrl adds; the reference engine the same). Takes the logits'
    bf16 rounding out of the engine/trainer mismatch at the cost of one fp32 GEMM per token."""
    max_staleness: int = 0
    """Asynchronous RL: 0 is the synchronous loop (each step's batch generated by the policy it
    trains). k >= 1: the engines generate the next batches while the trainer trains, batch s by
    the policy of step max(0, s - k) (a function of the step, so resumes are exact); the loss
    corrects for the stale behaviour policy (decoupled PPO, docs/async.md)."""
    rescore_per_group: int = 1
    """Asynchronous runs (max_staleness >= 1): the sync check has the engines score again this many
    completions of each prompt group (the first ones) while they hold the trainer's version, in
    [1, algorithm.group_size]. Scoring costs the engines about 0.7x of sampling the same tokens, on
    the critical path once generation takes about as long as training (docs/async.md)."""
    partial: bool = False
    """Partial rollouts (needs max_staleness >= 2): a batch is sampled by every version pushed while
    it waits, each adding at most ceil(max_new_tokens / max_staleness) tokens to each completion, the
    last before its step finishing it; every token keeps its version (docs/async.md)."""
    weight_sync: str = "auto"
    """auto | shard | broadcast. shard: every trainer rank sends its Megatron shards straight to the
    engines along a moe plan (the reference engine's extension route; SGLang's Qwen3-MoE engines
    through hpcrl's --custom-weight-loader, docs/sglang_shard_route.md). broadcast: full HF
    tensors in buckets over SGLang's update_weights_from_distributed, from every trainer rank that is a
    source of some tensors, engines taken in turns (hpcrl/trainer/broadcast_sync.py). auto: shard
    for the reference engine on CPU, broadcast otherwise (the reference engine's shard route runs
    over gloo on CPU tensors; SGLang's has not run on a GPU yet)."""
    sync_checksum: str = "sampled"
    """sampled | full | off: the checksum of every point-to-point round of a weight sync (shard sync,
    and the broadcast path's gather). sampled: every message's length and a 32nd of its bytes,
    a different 32nd each sync (every byte once in 32 syncs); full: every byte (on CPU about
    half the cost of moving the bytes); off: none. The log-prob check runs every step regardless."""


@dataclass(kw_only=True)
class RewardConfig:
    fn: str = "token_match"
    """Built-in reward name (see hpcrl/rewards/builtin.py) or `package.module:function`."""
    num_workers: int = 2
    """Worker processes (on the controller's node) that score completions."""
    timeout_s: float = 10.0
    """Deadline of one completion's score; a reward that raises or runs past it scores 0 and is
    counted in reward/errors."""
    max_failed_steps: int = 3
    """Stop the run (exit 2, the last completed step saved) when the reward failed on every
    completion of this many steps in a row (all scored 0: the policy learns nothing); 0 never stops."""


@dataclass(kw_only=True)
class EvalConfig:
    interval_steps: int = 0
    """Evaluate on `data.val_path` every N steps (and after the last step); 0 disables."""
    num_samples: int = 1
    """Completions per held-out prompt (the k of val/pass@k)."""
    temperature: float = 0.0
    """Sampling temperature of evaluation; 0 is greedy (then num_samples must be 1)."""
    max_prompts: int = 0
    """Held-out prompts per evaluation (the first N rows); 0: every row."""
    before_train: bool = False
    """Also evaluate the initial policy before the first update (verl's trainer.val_before_train),
    logged as step -1; a resumed run does not repeat it."""


@dataclass(kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory (relative to the job file); null means RUN_DIR/checkpoints."""
    interval_steps: int = 0
    """Save every N steps; 0 saves only at the end and on preemption."""
    keep: int = 3
    """How many complete checkpoints to keep."""
    grace_s: float = 60.0
    """Seconds between the preemption signal (SIGUSR1/SIGTERM) and the kill: the controller finishes
    the current step only if it and a save fit in this budget, else it abandons the step."""


@dataclass(kw_only=True)
class ResourcesConfig:
    device: str = "cpu"
    """cpu | cuda."""
    nodes: int = 1
    """Nodes of the trainer component (Slurm); 1 for local runs."""
    rollout_nodes: int = 0
    """Nodes of the rollout component (Slurm); 0 colocates rollout with the trainer."""
    gpus_per_node: int = 0
    """GPUs per node requested from Slurm (device cuda); 0 with device cpu."""
    share_gpus: bool = False
    """Let ranks of a node share GPUs when it has fewer than they need (one per trainer rank,
    rollout.tp_per_engine per engine); false refuses such layouts (hpcrl/rollout/placement.py)."""
    cpus_per_rank: int = 1
    """CPU cores per rank (Slurm --cpus-per-task)."""
    cpu_bind: str = "none"
    """none | auto | apart. `hpcrl run` with device cpu: auto runs trainer rank i and engine i on one
    block of cpus_per_rank cores (they take turns) and the controller on the cores left
    (hpcrl/cpu_bind.py); apart gives every trainer rank and every engine a block of its own (for
    rollout.max_staleness >= 1, when they run at once); none leaves placement to the OS. GPU runs and
    Slurm steps (srun's binding) are not bound."""
    timeout_s: float = 300.0
    """Deadline of one phase of one step (any MPI wait); a rank silent longer is reported and the
    job stops."""
    startup_timeout_s: float = 600.0
    """Deadline for all ranks to start (imports, model build, engine launch)."""


@dataclass(kw_only=True)
class NetworkConfig:
    """The hardware model of `hpcrl plan` (default: H100 DGX nodes); runs ignore it."""

    gpus_per_node: int = 8
    """GPUs per node; ranks fill nodes in order (trainer nodes first, then rollout nodes)."""
    nics_per_node: int = 8
    """InfiniBand NICs per node; each GPU uses a 1/gpus_per_node share of their bandwidth."""
    nic_gbit_per_s: float = 400.0
    """Line rate of one NIC per direction, in Gbit/s (NDR: 400)."""
    nvlink_gbyte_per_s: float = 450.0
    """NVLink bandwidth of one GPU per direction, in GB/s (H100 SXM: 450)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GiB (2^30 bytes); plan fails when a layout needs more per GPU."""
    memory_budget_gb: float = 1.0
    """Staging memory per GPU per weight-transfer round in GiB: received plus sent bytes in flight."""


@dataclass(kw_only=True)
class LoggingConfig:
    run_dir: str | None = None
    """Run directory (relative to the job file); null means runs/<name>-<timestamp> under the current
    directory. `hpcrl run --run-dir` overrides it."""
    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""
    progress: bool = True
    """Progress bar on stderr (step, reward, step time)."""
    rollout_samples: int = 0
    """Completions of each step (and of each evaluation) written as text with their rewards to
    RUN_DIR/rollouts/ (hpcrl/controller/samples.py): the first N; -1: all; 0: none."""
    wandb_project: str | None = None
    """Weights & Biases project that gets every metrics record (needs the wandb package: `bash
    install.sh --wandb`); null: no W&B. wandb reads WANDB_MODE (offline on nodes without internet,
    `wandb sync` later), WANDB_ENTITY and WANDB_API_KEY itself."""
    wandb_name: str | None = None
    """Name of the W&B run; null: the run dir's name."""
    profile_steps: list[int] = field(default_factory=list)
    """RL steps whose torch.profiler traces (every trainer rank, every engine) go to
    RUN_DIR/profile/step_NNNNNN/ (hpcrl/profiling.py); [] profiles none."""


@dataclass(kw_only=True)
class SlurmConfig:
    partition: str | None = None
    """Partition (sbatch --partition); null means the cluster's default partition."""
    account: str | None = None
    """Account to charge (sbatch --account); null leaves it to Slurm's default."""
    qos: str | None = None
    """Quality of service (sbatch --qos); null leaves it to Slurm's default."""
    time: str = "01:00:00"
    """Time limit of one attempt, a quoted Slurm time string: minutes ('90'), 'H:M:S' or 'D-H:M:S'
    (YAML reads unquoted 30:00 as the number 1800)."""
    mem_gb: int = -1
    """Memory per node in GB (sbatch --mem); -1 leaves it to the partition, 0 asks for all of it."""
    mpi: str = "pmi2"
    """srun --mpi plugin that starts the one MPI world: pmi2 (PyPI mpich) | pmix."""
    signal_delay_s: int = 120
    """Slurm sends USR1 this many seconds before the time limit (and at preemption) so the
    controller can checkpoint and requeue; must be shorter than `time`."""
    max_requeues: int = 3
    """Requeues in a row that saved no newer checkpoint than the attempt started from, after which the
    job stops instead of requeueing again (and says why): a step that cannot finish before the signal
    would otherwise requeue forever. 0 never requeues without progress."""
    python: str | None = None
    """Python interpreter of the ranks; null means the one running `hpcrl submit`. Set it (e.g.
    'python') when `env_setup` activates the environment on the compute nodes."""
    env_setup: list[str] = field(default_factory=list)
    """Shell lines run before the step, unchanged: module loads, venv or conda activation."""
    extra_sbatch_options: list[str] = field(default_factory=list)
    """sbatch options written unchanged into component 0 (trainer nodes; the whole job when
    colocated), e.g. '--constraint=h100' or '--exclusive'."""
    rollout_extra_sbatch_options: list[str] = field(default_factory=list)
    """sbatch options written unchanged into component 1 (rollout nodes, resources.rollout_nodes > 0)."""
    extra_srun_options: list[str] = field(default_factory=list)
    """srun options of the step, written unchanged after hpcrl's own (e.g. '--cpu-bind=none')."""


@dataclass(kw_only=True)
class JobConfig:
    name: str = "job"
    """Job name: letters, digits, '.', '_', '-' (run directory and Slurm job name)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    base_dir: str = field(default=".", metadata={"internal": True})
    """Directory of the job file; relative paths resolve against it (not a YAML key)."""

    @property
    def world_size(self) -> int:
        """Ranks of the MPI world: controller + trainer ranks + one rollout rank per engine node."""
        return 1 + self.trainer.num_procs + rollout_ranks(self)


def rollout_ranks(job: JobConfig) -> int:
    """Rollout ranks: one per node of every engine (rollout.num_engines x rollout.nodes_per_engine)."""
    return job.rollout.num_engines * job.rollout.nodes_per_engine


def engine_dtype(job: JobConfig) -> str:
    """The engines' weight dtype: `rollout.dtype`, or model.dtype when it is auto. Weight syncs move
    the policy at this dtype."""
    return job.model.dtype if job.rollout.dtype == "auto" else job.rollout.dtype


def engine_routes(job: JobConfig) -> bool:
    """Whether the engines return their MoE routes: rollout.routing_replay observe or r3 (r2 replays
    the trainer's own)."""
    return job.rollout.routing_replay in ("observe", "r3")


def weight_sync_mode(job: JobConfig) -> str:
    """`rollout.weight_sync` with auto decided: "shard" or "broadcast"."""
    r = job.rollout
    if r.weight_sync != "auto":
        return r.weight_sync
    return "shard" if r.backend == "reference" and job.resources.device == "cpu" else "broadcast"


def rollout_correction(job: JobConfig) -> str:
    """The loss's rollout correction: algorithm.rollout_correction, except that an asynchronous run
    (rollout.max_staleness >= 1) left at none gets tis: decoupled PPO's behaviour weight pi_old /
    pi_engine on stale samples, truncated at algorithm.tis_cap (docs/async.md)."""
    a = job.algorithm
    return "tis" if a.rollout_correction == "none" and job.rollout.max_staleness > 0 else a.rollout_correction


def data_parallel_size(job: JobConfig) -> int:
    """The trainer's data-parallel ranks: trainer.num_procs / (tp * pp * cp), at least 1."""
    t = job.trainer
    return max(1, t.num_procs // (t.tp * t.pp * t.cp))


def splits_into_mini_batches(rows: int, mini_batch_size: int, dp: int) -> bool:
    """Whether mini-batches of `mini_batch_size` rows (0: the whole batch) split a batch of `rows`
    evenly, each over the `dp` data-parallel ranks (MegatronPolicy.update)."""
    return not mini_batch_size or (rows % mini_batch_size == 0 and mini_batch_size % dp == 0)


def critic_enabled(job: JobConfig) -> bool:
    """Whether the trainer ranks build PPO's critic (hpcrl/trainer/critic.py)."""
    return job.algorithm.name == "ppo" or job.critic.enabled
