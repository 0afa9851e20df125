"""hpcrl/algorithms. The names below are importable without torch (config validation uses them)."""

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
