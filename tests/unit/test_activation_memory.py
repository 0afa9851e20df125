"""moe/activation_memory.py, the activations `hpcrl plan` counts, against arithmetic done by hand
(the two terms are measured on CPU in tests/megatron/test_recompute.py): the micro-batches 1F1B
keeps in flight per stage, the chunk inputs of each recompute method under sequence and context
parallelism, the log-prob head on the last stage, and what stays uncounted."""

from __future__ import annotations

import pytest

from moe.activation_memory import StepShape, activation_memory
from moe.layouts import TrainerLayout
from moe.specs import ModelDims

DIMS = ModelDims(num_layers=10, hidden_size=1024, vocab_size=1000, num_heads=8, num_kv_heads=8, num_experts=8,
                 intermediate_size=0, moe_intermediate_size=256, shared_intermediate_size=0,
                 tie_word_embeddings=False)


def step(**kw) -> StepShape:
    return StepShape(**{"seq_len": 4096, "response_len": 3000, "micro_batch_size": 2, "num_micro_batches": 8,
                        "recompute": "full", **kw})


def test_full_uniform_recompute_under_pipeline_tensor_and_context_parallelism() -> None:
    """pp 4 with stages of 1, 3, 3, 3 layers; chunks of 2 layers (ceil); tp 2 with sequence parallel
    and cp 2 split the 4096 positions four ways; bf16. The vocab shard is ceil(1000 / 2) = 500."""
    layout = TrainerLayout(tp=2, cp=2, pp=4, first_stage_layers=1, vocab_divisible_by=1)
    out = activation_memory(DIMS, layout, step(recompute_num_layers=2), 2)
    per_input = 1024 * 2 * 1024 * 2  # [4096 / 4, mb 2, H 1024] bf16
    head = 4 * 2 * 1500 * 500  # float32 exp [mb 2, 3000 / cp, 500]
    assert [(st["layers"], st["in_flight"]) for st in out["per_stage"]] == [(1, 4), (3, 3), (3, 2), (3, 1)]
    assert [st["layer_inputs_bytes"] for st in out["per_stage"]] == [4 * 1 * per_input, 3 * 2 * per_input,
                                                                     2 * 2 * per_input, 1 * 2 * per_input]
    assert [st["head_bytes"] for st in out["per_stage"]] == [0, 0, 0, head]
    assert out["bytes_per_gpu"] == max(6 * per_input, 2 * per_input + head)
    assert out["not_counted"] == ("one chunk's recomputation in the backward and the forward's transients, one "
                                  "micro-batch at a time")


def test_fewer_micro_batches_than_stages_are_all_in_flight_and_the_entropy_bonus_keeps_the_logits() -> None:
    layout = TrainerLayout(pp=2)  # tp 1: no sequence parallelism; Megatron's vocab padding to 128
    out = activation_memory(DIMS, layout, step(num_micro_batches=1, entropy_grad=True), 4)
    assert [st["in_flight"] for st in out["per_stage"]] == [1, 1]
    assert out["per_stage"][0]["layer_inputs_bytes"] == 5 * 4096 * 2 * 1024 * 4
    assert out["per_stage"][1]["head_bytes"] == 8 * 2 * 3000 * 1024


def test_what_is_not_counted_is_said() -> None:
    """Block recomputation keeps the inputs of each stage's first layers and every activation of the
    others; without full recomputation no layer is counted."""
    layout = TrainerLayout(pp=2, vocab_divisible_by=1)
    block = activation_memory(DIMS, layout, step(recompute_method="block", recompute_num_layers=2), 2)
    assert [st["layer_inputs_bytes"] for st in block["per_stage"]] == [2 * 2 * 4096 * 2 * 1024 * 2,
                                                                       1 * 2 * 4096 * 2 * 1024 * 2]
    assert block["not_counted"].startswith("the own activations of 6 decoder layers (the layers block "
                                           "recomputation leaves whole")
    none = activation_memory(DIMS, layout, step(recompute="none"), 2)
    assert [st["layer_inputs_bytes"] for st in none["per_stage"]] == [0, 0]
    assert none["bytes_per_gpu"] == none["per_stage"][1]["head_bytes"] == 4 * 2 * 3000 * 1000
    assert none["not_counted"] == ("the own activations of 10 decoder layers (trainer.recompute_granularity is "
                                   "not full: they depend on the kernels); the forward's transients, one "
                                   "micro-batch at a time")


@pytest.mark.parametrize("bad, match", [
    ({"seq_len": 0}, "StepShape.seq_len=0 must be a positive int"),
    ({"micro_batch_size": True}, "StepShape.micro_batch_size=True"),
    ({"response_len": 5000}, "response_len=5000 exceeds seq_len=4096"),
    ({"recompute": "partial"}, "StepShape.recompute='partial'; valid: none, full, selective"),
    ({"recompute_method": "chunk"}, "StepShape.recompute_method='chunk'"),
])
def test_a_bad_step_shape_is_refused(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        step(**bad)
