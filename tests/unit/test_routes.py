"""The engines' MoE routes on the controller side: SGLang 0.5.23's meta_info.routed_experts (base64 of
little-endian int32 [P + R - 1, num_hidden_layers, top_k]) kept compactly for the MoE layers, carried
by reference through Rollout.select / concat and to the trainer's batch; a missing or misshapen
answer is an error naming the completion."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from hpcrl.controller.groups import Rollout
from hpcrl.controller.routes import RouteFormat, RoutesError
from hpcrl.trainer.batch import TrainBatch

FMT = RouteFormat(num_layers=3, moe_layers=(1, 2), top_k=2, num_experts=8)  # tiny-deepseek-v3's shape


def answer(routes_TLK: np.ndarray) -> dict:
    return {"routed_experts": base64.b64encode(routes_TLK.astype("<i4").tobytes()).decode()}


def test_decode_keeps_the_moe_layers_compactly():
    rng = np.random.default_rng(0)
    full = rng.random((6, 3, 8)).argsort(-1)[..., :2]  # top-2: two distinct experts
    full[:, 0] = 0  # the dense layer's rows, as SGLang leaves them
    got = FMT.decode(answer(full), num_tokens=7, where="completion 0")
    assert got.dtype == np.uint8 and got.shape == (6, 2, 2)
    assert np.array_equal(got, full[:, 1:])
    assert RouteFormat(4, (0,), 2, 300).dtype == np.int16


@pytest.mark.parametrize(("meta", "num_tokens", "message"), [
    ({}, 7, "--enable-return-routed-experts"),
    (answer(np.zeros((5, 3, 2))), 7, "expected (tokens - 1) x layers x top_k = 6 x 3 x 2"),
    (answer(np.full((6, 3, 2), 8)), 7, "outside [0, 8)"),
    (answer(np.tile([0, 1], (6, 3, 1)) * np.arange(6)[:, None, None] % 5), 7,
     "token 0 goes to one expert twice in MoE layer 1 ([0, 0]); a top-2 route names 2 distinct experts"),
])
def test_decode_refuses_what_does_not_fit(meta, num_tokens, message):
    with pytest.raises(RoutesError, match=None) as info:
        FMT.decode(meta, num_tokens, "step 3, completion 5")
    assert "step 3, completion 5" in str(info.value) and message in str(info.value)


def test_rollout_moves_routes_by_reference_and_the_batch_places_them():
    routes = [np.full((n - 1, 2, 2), i, dtype=np.uint8) for i, n in enumerate((4, 3, 5))]
    r = Rollout([None] * 3, [[1, 2], [1], [3, 4, 5]], [[7, 8], [9, 9], [6, 6]], [[0.0] * 2] * 3, ["stop"] * 3, routes)
    picked = Rollout.concat([r.select([2, 0]), r.select([1])])
    assert [id(x) for x in picked.routes] == [id(routes[2]), id(routes[0]), id(routes[1])]  # no copies
    assert Rollout.concat([r, Rollout([], [], [], [], [])]).routes is None  # a part without routes
    batch = TrainBatch.from_lists(picked.prompt_ids, picked.response_ids, picked.token_batch()["routes"])
    assert batch.routes_BLNK.shape == (3, 5, 2, 2) and batch.routes_BLNK.dtype == torch.uint8
    assert (batch.routes_BLNK[0, :4] == 2).all() and (batch.routes_BLNK[1, :3] == 0).all()
    filler = torch.tensor([0, 1], dtype=torch.uint8)  # K distinct ids where no route exists
    assert (batch.routes_BLNK[1, 3:] == filler).all() and (batch.routes_BLNK[2, 2:] == filler).all()
    with pytest.raises(ValueError, match="row 0: 3 routes for 5 tokens"):
        TrainBatch.from_lists([[1, 2, 3]], [[4, 5]], [np.zeros((3, 2, 2))])
