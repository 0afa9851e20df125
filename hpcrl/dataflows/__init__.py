"""Built-in RL algorithms, one module each, every one a `step(rl, step)` over the controller's public
API (hpcrl/controller/api.py) and the tensor functions of hpcrl/algorithms; `algorithm.name` picks
one, or names a user's module of the same shape. Formulas: docs/algorithms.md.

    grpo          group-normalised advantages, clipped loss + KL to the reference (DeepSeekMath)
    dr_grpo       group-centred advantages, token sums over a constant (Dr. GRPO)
    rloo          leave-one-out baseline (Ahmadian et al.)
    reinforce_pp  KL penalty in the token rewards, batch-whitened returns (REINFORCE++)
    gspo          sequence-level ratio and clip (GSPO)
    dapo          dynamic sampling, overlong shaping, clip-higher, token-level loss (DAPO)
    ppo           GAE advantages from a Megatron critic, KL penalty in the reward (PPO)
    sft           cross-entropy on the data's answers, no generation

Each module declares `DEFAULTS` (and `FIXED`): the values its algorithm gives the algorithm.* keys a
job leaves unset, read by the config without importing the module (_declared.py).
"""
