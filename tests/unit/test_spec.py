"""Specifications: presets, TOML loading and the errors a user sees for bad input."""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from chameleon_ft.perf import Topology
from chameleon_ft.spec import (
    DEVICE_PRESETS,
    MODEL_PRESETS,
    ClusterSpec,
    JobSpec,
    config_from_mapping,
    load_config,
    model_preset,
)

BASE = {
    "model": {"preset": "llama2-7b"},
    "cluster": {"num_nodes": 4, "devices_per_node": 8, "device": "a100-80g"},
    "job": {"pp": 4, "dp": 8, "global_batch": 256},
}


def with_(section: str, **changes: object) -> dict[str, dict[str, object]]:
    doc = {k: dict(v) for k, v in BASE.items()}
    doc.setdefault(section, {}).update(changes)
    return doc


def test_required_presets_exist() -> None:
    for name in ("gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "llama2-7b", "llama2-13b",
                 "llama3-8b", "llama3-70b"):
        assert name in MODEL_PRESETS
    for name in ("a100-80g", "h100-80g", "h200", "ascend-910b", "cpu"):
        assert name in DEVICE_PRESETS
    assert model_preset("llama3-70b").kv_heads == 8
    assert model_preset("gpt3-1.3b").ffn == 4 * 2048


def test_loads_a_valid_config() -> None:
    config = config_from_mapping(BASE)
    assert config.num_workers == 32
    assert config.workers_per_node == 8
    assert config.model is not None and config.model.num_layers == 34


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        (with_("model", preset="gpt5"), "model.preset"),
        (with_("cluster", device="tpu9"), "cluster.device"),
        (with_("job", dp=4), "job.dp"),
        (with_("job", pp=40, dp=1, tp=1, global_batch=8), "job.dp"),
        (with_("job", global_batch=255), "job.global_batch"),
        (with_("job", global_batch=260), "job.global_batch"),
        (with_("job", stages=4), "job.stages"),
        (with_("profile", kind="uniform", num_layers=4, fwd_s=-1.0), "profile.fwd_s"),
        (with_("cluster", inter_node_gb_per_s=-5.0), "cluster.inter_node_gb_per_s"),
        (with_("job", schedule="zigzag"), "job.schedule"),
        (with_("job", tp=3), "job.tp"),
        ({**BASE, "extras": {}}, "extras"),
        (with_("cluster", spare_nodes=-1), "cluster.spare_nodes"),
        (with_("cluster", spare_nodes=1.5), "cluster.spare_nodes"),
        (with_("recovery", memory_checkpoint_every=0), "recovery.memory_checkpoint_every"),
        (with_("recovery", memory_checkpoint=True, checkpoint=False),
         "recovery.memory_checkpoint"),
    ],
)
def test_bad_input_names_the_field(doc: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError) as err:
        config_from_mapping(doc)
    assert str(err.value).startswith(field), str(err.value)


def test_more_stages_than_layers() -> None:
    doc = {
        "cluster": {"num_nodes": 1, "devices_per_node": 8},
        "job": {"pp": 8, "dp": 1, "global_batch": 8},
        "profile": {"kind": "uniform", "num_layers": 4, "fwd_s": 1.0},
    }
    with pytest.raises(ValueError, match=r"^job\.pp"):
        config_from_mapping(doc)


def test_uniform_profile_needs_no_model_or_device() -> None:
    doc = {
        "cluster": {"num_nodes": 2, "devices_per_node": 2, "ideal_network": True},
        "job": {"pp": 2, "dp": 2, "global_batch": 8},
        "profile": {"kind": "uniform", "num_layers": 4, "fwd_s": 1.0, "bwd_input_s": 1.0},
    }
    config = config_from_mapping(doc)
    assert config.model is None and config.cluster.device is None


def test_analytic_profile_requires_a_device() -> None:
    doc = with_("cluster")
    del doc["cluster"]["device"]
    with pytest.raises(ValueError, match=r"^cluster\.device"):
        config_from_mapping(doc)


def test_model_overrides_and_device_table(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent("""
        [model]
        preset = "llama2-7b"
        seq_len = 2048
        [cluster]
        num_nodes = 1
        devices_per_node = 4
        [cluster.device]
        preset = "h100-80g"
        mfu = 0.5
        [job]
        pp = 2
        dp = 2
        global_batch = 16
        placement = "pipeline-major"
    """))
    config = load_config(path)
    assert config.model is not None and config.model.seq_len == 2048
    assert config.cluster.device is not None and config.cluster.device.mfu == 0.5
    assert config.cluster.device.peak_flops == DEVICE_PRESETS["h100-80g"].peak_flops
    assert config.job.worker_id(1, 0) == 2


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[job\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(bad)


def test_worker_numbering() -> None:
    job = JobSpec(pp=4, dp=8, global_batch=64)
    assert job.worker_id(pipeline=3, stage=2) == 2 * 8 + 3
    cluster = ClusterSpec(num_nodes=4, devices_per_node=8)
    assert cluster.link(True)[1] > cluster.link(False)[1]


def test_spare_nodes_follow_the_jobs_and_count_in_the_topology() -> None:
    config = config_from_mapping(with_("cluster", spare_nodes=2))
    assert config.num_workers == 32  # the layout's workers
    assert config.num_spare_workers == 16
    assert config.total_workers == 48
    assert config.cluster.num_devices == 32 and config.cluster.total_nodes == 6
    topology = Topology.from_config(config)
    assert topology.num_workers == 48 and topology.num_nodes == 6
    assert topology.node_of(40) == 5
    # a one-node job with a spare node: which worker runs where matters again
    one = config_from_mapping({"cluster": {"num_nodes": 1, "devices_per_node": 8,
                                           "spare_nodes": 1},
                               "job": {"pp": 2, "dp": 4, "global_batch": 8},
                               "profile": {"kind": "uniform", "num_layers": 4, "fwd_s": 1.0}})
    assert not Topology.from_config(one).placement_free
    assert Topology.from_config(replace(one, cluster=replace(one.cluster, spare_nodes=0))
                                ).placement_free
