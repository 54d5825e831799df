"""A head tied to the embedding in the planning core: the profile carries the shared
weight's bytes and both copies count in memory."""

from __future__ import annotations

import dataclasses
import json

import pytest

from chameleon_ft.perf import Topology, estimate
from chameleon_ft.plan import ExecutionPlan
from chameleon_ft.profile import (
    Profile,
    analytic_profile,
    fold_profile,
    unfold_profile,
    uniform_profile,
)
from chameleon_ft.spec import ClusterSpec, ModelSpec, device_preset

SMALL = ModelSpec(name="small", num_blocks=6, hidden_size=256, num_heads=4,
                  vocab_size=5000, seq_len=128, tied_embeddings=True)
"""8 planner layers: embedding, 6 blocks, head; tied."""
CLUSTER = ClusterSpec(num_nodes=4, devices_per_node=2)


def _profiles(model: ModelSpec = SMALL, tp: int = 1,
              train_dtype: str | None = None) -> tuple[Profile, Profile]:
    """(tied, untied) analytic profiles of ``model`` on an A100."""
    return tuple(  # type: ignore[return-value]
        analytic_profile(dataclasses.replace(model, tied_embeddings=tied),
                         device_preset("a100-80g"), cluster=CLUSTER, tp=tp,
                         train_dtype=train_dtype)
        for tied in (True, False))


# ------------------------------------------------------------------ the profile


@pytest.mark.parametrize(("tp", "train_dtype", "weight_bytes"),
                         [(1, None, 2), (2, None, 2), (1, "float32", 4), (2, "float64", 8)])
def test_analytic_tied_bytes_are_the_shared_matrix_per_device(
        tp: int, train_dtype: str | None, weight_bytes: int) -> None:
    tied, untied = _profiles(tp=tp, train_dtype=train_dtype)
    v, h = SMALL.vocab_size, SMALL.hidden_size
    assert tied.tied_bytes == weight_bytes * v * h / tp
    # the same convention as the layers' parameter bytes: the embedding is exactly it
    assert tied.tied_bytes == tied.layers[0].param_bytes
    assert untied.tied_bytes == 0.0


def test_tied_profile_round_trips_json() -> None:
    tied, _ = _profiles(tp=2)
    text = tied.to_json()
    assert json.loads(text)["tied_bytes"] == tied.tied_bytes > 0
    again = Profile.from_json(text)
    assert again == tied and again.tied_bytes == tied.tied_bytes


def test_a_profile_file_without_tied_bytes_loads_untied() -> None:
    tied, _ = _profiles()
    doc = json.loads(tied.to_json())
    del doc["tied_bytes"]  # as written before ties were priced
    old = Profile.from_json(json.dumps(doc))
    assert old.tied_bytes == 0.0 and old.layers == tied.layers


@pytest.mark.parametrize("value", [-1.0, "1e6", float("nan"), True])
def test_bad_tied_bytes_are_refused_by_name(value: object) -> None:
    doc = json.loads(uniform_profile(4).to_json())
    doc["tied_bytes"] = value
    with pytest.raises(ValueError, match=r"profile\.tied_bytes"):
        Profile.from_json(json.dumps(doc))
    with pytest.raises(ValueError, match=r"profile\.tied_bytes"):
        dataclasses.replace(uniform_profile(4), tied_bytes=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(("v", "attach", "head_column"), [(3, False, 1), (2, False, 3),
                                                          (3, True, 1), (2, True, 2)])
def test_folding_keeps_the_tie_in_the_head_s_column(v: int, attach: bool,
                                                    head_column: int) -> None:
    """8 layers in 3 rounds are cut 3, 3, 2: the head is column 1 of 3, not the last.
    Attached ends leave 6 slots (3 of 2, or 2 of 3)."""
    tied, _ = _profiles()
    folded = fold_profile(tied, v, attach_ends=attach)
    assert folded.tied_bytes == tied.tied_bytes
    assert folded.tied_layers == (0, head_column)
    assert folded.rounds[-1][-1].name.endswith("head")
    assert Profile.from_json(folded.to_json()).tied_layers == (0, head_column)
    unfolded = unfold_profile(folded)  # attached ends stay joined to their blocks
    assert unfolded.tied_layers == (0, unfolded.num_layers - 1)
    assert unfolded.layers[-1].name.endswith("head") and unfolded.tied_bytes == tied.tied_bytes


# ------------------------------------------------------------------ memory


def test_each_holder_is_charged_its_own_copy() -> None:
    """Tied or not, the embedding and the head each hold the V x h matrix (parameters,
    gradients, optimizer state): the layers, and so every memory figure, are the same."""
    for tp in (1, 2):
        tied, untied = _profiles(tp=tp)
        assert tied.layers == untied.layers
        v, h = SMALL.vocab_size, SMALL.hidden_size
        assert tied.layers[0].param_bytes == 2 * v * h / tp
        assert tied.layers[-1].param_bytes == 2 * (v * h + h) / tp  # matrix + final norm
        assert tied.layers[-1].static_bytes == 16 * (v * h + h) / tp
        assert tied.total_param_bytes == pytest.approx(
            2 * (2 * v * h + h + SMALL.num_blocks * SMALL.block_params()) / tp)
    topo = Topology(CLUSTER, 2)
    for dp, pp in ((1, 1), (2, 2), (1, 4)):
        plan = ExecutionPlan.uniform(dp=dp, pp=pp, num_layers=tied.num_layers,
                                     num_microbatches=4 * dp)
        a, b = estimate(plan, tied, topo), estimate(plan, untied, topo)
        assert dict(a.peak_memory_bytes) == dict(b.peak_memory_bytes)
        # the first and the last stage each carry a full copy's 16 bytes a parameter
        first, last = plan.pipelines[0].stages[0].worker, plan.pipelines[0].stages[-1].worker
        assert a.peak_memory_bytes[first] >= 16 * v * h / 2
        assert a.peak_memory_bytes[last] >= 16 * v * h / 2
