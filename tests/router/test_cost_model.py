"""Cost models: the built-in mooncake-70b constants, files, and `pdcluster profile` fits."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from pdcluster.deploy.profile import add_profile_parser, fit_nonnegative, run_profile
from pdcluster.engine.config import BUNDLED_MODEL
from pdcluster.router.cost_model import (BUILTIN_COST_MODELS, MOONCAKE_70B, CostModel,
                                         load_cost_model, save_cost_model)


def test_mooncake_70b_constants():
    m = MOONCAKE_70B
    assert m.t_prefill(12_000) == pytest.approx(0.05 + 8.3e-5 * 12_000 + 2.1e-9 * 12_000 * 6_000)
    assert m.t_prefill(1000, 5000) == pytest.approx(0.05 + 0.083 + 2.1e-9 * 1000 * 5500)
    assert m.t_prefill(0, 5000) == 0.0
    assert m.t_step(32, 400_000) == pytest.approx(0.0125 + 2.9e-8 * 400_000)
    assert m.t_step(0, 0) == 0.0
    assert m.kv_bytes_per_token == 320 * 1024
    assert m.t_transfer_tokens(10_000) == pytest.approx(0.005 + 10_000 * 327_680 / 87e9)
    assert m.dram_cache_tokens == 3_000_000


def test_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "m.json"
    custom = replace(MOONCAKE_70B, name="custom", dram_cache_tokens=10)
    save_cost_model(custom, path, {"note": 1})
    assert load_cost_model(str(path)) == custom
    assert load_cost_model("mooncake-70b") is BUILTIN_COST_MODELS["mooncake-70b"]
    with pytest.raises(ValueError, match="no such file"):
        load_cost_model(str(tmp_path / "missing.json"))
    path.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="missing"):
        load_cost_model(str(path))
    with pytest.raises(ValueError, match="unknown"):
        CostModel.from_json({**MOONCAKE_70B.to_json(), "bogus": 1})


def test_a_file_without_the_tensor_parallel_fields_loads_with_their_defaults():
    data = {k: v for k, v in MOONCAKE_70B.to_json().items()
            if k not in ("tensor_parallel_size", "weights_bytes", "device_memory_bytes")}
    model = CostModel.from_json(data)
    assert (model.tensor_parallel_size, model.weights_bytes, model.device_memory_bytes) == \
        (1, 0, 0)


def test_tensor_parallel_moves_compute_and_kv_room():
    m = MOONCAKE_70B
    assert m.at_tensor_parallel(8) is m
    tp4 = m.at_tensor_parallel(4, efficiency=0.85)
    # speed(t) = t * 0.85^log2(t): speed(8) / speed(4) = 2 * 0.85
    assert tp4.t_prefill(8000) == pytest.approx(m.t_prefill(8000) * 2 * 0.85)
    assert tp4.t_step(8, 100_000) == pytest.approx(m.t_step(8, 100_000) * 2 * 0.85)
    # (4 x 72 GB - 140 GB) / 320 KiB; at 8 the model's own figure
    assert tp4.decode_kv_tokens == (4 * 72 * 10**9 - 140 * 10**9) // (320 * 1024)
    assert m.decode_kv_tokens == pytest.approx((8 * 72e9 - 140e9) / (320 * 1024), rel=1e-3)
    assert tp4.transfer_bytes_per_s == m.transfer_bytes_per_s
    assert m.at_tensor_parallel(16).t_prefill(8000) < m.t_prefill(8000)
    with pytest.raises(ValueError, match="no KV room on 1 devices"):
        m.at_tensor_parallel(1)
    with pytest.raises(ValueError, match=">= 1"):
        m.at_tensor_parallel(0)
    # unknown memory: KV room scales with the devices
    cpu = BUILTIN_COST_MODELS["stories260k-cpu"]
    assert cpu.at_tensor_parallel(2).decode_kv_tokens == 2 * cpu.decode_kv_tokens


def test_fit_nonnegative_drops_negative_terms():
    x = np.array([[1.0, n, n * n] for n in range(1, 20)])
    y = 0.5 + 0.1 * x[:, 1]
    assert fit_nonnegative(x, y) == pytest.approx([0.5, 0.1, 0.0], abs=1e-9)
    y2 = 2.0 - 0.01 * x[:, 1] + 0.001 * x[:, 2]
    assert (fit_nonnegative(x, y2) >= 0).all()


def test_profile_fits_the_bundled_model(tmp_path):
    import argparse

    parser = argparse.ArgumentParser()
    add_profile_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "cost.json"
    args = parser.parse_args(["profile", "--repeats", "1", "--num-kv-blocks", "256",
                              "--output", str(out)])
    assert run_profile(args) == 0
    model = load_cost_model(str(out))
    assert model.name == "profiled-stories260K" and model.kv_bytes_per_token > 0
    assert model.decode_kv_tokens == 256 * 16
    data = json.loads(out.read_text())
    assert data["samples"]["prefill"] and data["samples"]["decode"]
    # the fit predicts its own samples to within a factor of 2 on the median
    ratios = [model.t_prefill(n, c) / s for n, c, s in data["samples"]["prefill"] if s > 0]
    assert 0.5 < float(np.median(ratios)) < 2.0


def test_transfer_paths_replace_the_model_figures_only_where_measured(tmp_path):
    paths = {"local": {"latency_s": 0.0, "bytes_per_s": 1e10},
             "remote": {"latency_s": 0.002, "bytes_per_s": 1e9},
             "pd:mooncake": {"latency_s": 0.001, "bytes_per_s": 2e9}}
    m = MOONCAKE_70B.with_transfer_paths(paths)
    n = 10 * MOONCAKE_70B.kv_bytes_per_token
    assert m.t_transfer(n, "remote") == pytest.approx(0.002 + n / 1e9)
    assert m.t_transfer(n) == MOONCAKE_70B.t_transfer(n)  # the model's own: 87 GB/s + 5 ms
    assert m.t_transfer(n, "pd") == MOONCAKE_70B.t_transfer(n)  # not measured
    assert m.for_connector("mooncake").t_transfer(n, "pd") == pytest.approx(0.001 + n / 2e9)
    assert m.for_connector("torch") is m
    assert m.t_load_tokens(10, 20) == pytest.approx(
        10 * m.kv_bytes_per_token / 1e10 + 0.002 + 20 * m.kv_bytes_per_token / 1e9)
    # nothing measured: one transfer of both, as before per-path figures existed
    assert MOONCAKE_70B.t_load_tokens(10, 20) == MOONCAKE_70B.t_transfer_tokens(30)
    path = tmp_path / "m.json"
    save_cost_model(m, path)
    assert load_cost_model(str(path)) == m
    bad = {**m.to_json(), "transfer_paths": {"remote": {"latency_s": 0.0, "bytes_per_s": 0}}}
    with pytest.raises(ValueError, match="bytes_per_s > 0"):
        CostModel.from_json(bad)


@pytest.mark.slow
@pytest.mark.server
def test_profile_measures_each_connector_between_two_processes(tmp_path):
    """`pdcluster profile --kv-transfer grpc,torch,mooncake`: each connector moves 1, 4, 16 and
    64 blocks of the bundled model's layout from a source process into the paged cache, and the
    file's per-path figures are the nonnegative least-squares line through its own samples.
    Nothing here compares two timings: on a loaded machine a small transfer's median can
    exceed a large one's, which says nothing about the profiler."""
    import argparse
    import importlib.util

    from tests.real_parts import MOONCAKE_HINT, real_part_present

    # without Mooncake the other two are still measured (under CI=true its absence fails)
    has_mooncake = real_part_present("Mooncake's Transfer Engine",
                                     importlib.util.find_spec("mooncake") is not None, MOONCAKE_HINT)
    connectors = ["grpc", "torch"] + (["mooncake"] if has_mooncake else [])
    parser = argparse.ArgumentParser()
    add_profile_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "cost.json"
    args = parser.parse_args(["profile", "--repeats", "3", "--num-kv-blocks", "128",
                              "--kv-transfer", ",".join(connectors), "--output", str(out)])
    assert run_profile(args) == 0
    model = load_cost_model(str(out))
    samples = json.loads(out.read_text())["samples"]["connectors"]
    assert set(samples) == set(connectors)
    assert set(model.transfer_paths) == {"local", "remote", *(f"pd:{c}" for c in connectors)}
    assert model.transfer_paths["remote"] == model.transfer_paths["pd:grpc"]
    hf = json.loads((BUNDLED_MODEL / "config.json").read_text())
    # K and V, per layer, 16 tokens a block, fp32 (the profile's cache)
    block_bytes = 2 * hf["num_hidden_layers"] * 16 * hf["num_key_value_heads"] * hf["head_dim"] * 4
    for connector, rows in samples.items():
        assert [b for b, _ in rows] == [n * block_bytes for n in (1, 4, 16, 64)], connector
        assert all(0 < t < 60 for _, t in rows), (connector, rows)
        figures = model.transfer_paths[f"pd:{connector}"]
        assert figures == pytest.approx(_nonnegative_line(rows), rel=1e-6), (connector, rows)
    assert parser.parse_args(["profile", "--kv-transfer", "nccl"]) and \
        run_profile(parser.parse_args(["profile", "--kv-transfer", "nccl",
                                       "--output", str(out)])) == 2


def _nonnegative_line(rows: list[list[float]]) -> dict[str, float]:
    """seconds = latency + bytes / bytes_per_s, fitted as fit_nonnegative documents it: the
    least-squares line, or where a term comes out negative, the other term alone."""
    x, y = np.array([r[0] for r in rows], float), np.array([r[1] for r in rows], float)
    per_byte, lat = np.polyfit(x, y, 1)
    if per_byte < 0 and lat >= 0:
        lat, per_byte = y.mean(), 0.0
    elif lat < 0:
        lat, per_byte = 0.0, max(float(x @ y / (x @ x)), 0.0)
    return {"latency_s": float(lat), "bytes_per_s": 1.0 / per_byte if per_byte > 0 else 1e15}


def test_for_kv_bytes_per_token_moves_the_model_bytes_and_keeps_capacity_bytes():
    m = MOONCAKE_70B.for_kv_bytes_per_token(64 * 1024)  # a fifth of 70B's 320 KiB
    assert m.t_transfer_tokens(10_000) == pytest.approx(0.005 + 10_000 * 65_536 / 87e9)
    assert m.dram_cache_tokens == 5 * MOONCAKE_70B.dram_cache_tokens
    assert m.decode_kv_tokens == 5 * MOONCAKE_70B.decode_kv_tokens
    assert m.t_prefill(1000) == MOONCAKE_70B.t_prefill(1000)
    assert MOONCAKE_70B.for_kv_bytes_per_token(320 * 1024) is MOONCAKE_70B
    with pytest.raises(ValueError, match=">= 1"):
        MOONCAKE_70B.for_kv_bytes_per_token(0)


@pytest.mark.parametrize("family", ["llama", "deepseek_v2"])
@pytest.mark.parametrize("cost_model", ["stories260k-cpu", "mooncake-70b"])
def test_the_conductor_predicts_with_the_served_models_bytes(tmp_path, family, cost_model):
    """Whatever the built-in figures were measured on, T_transfer moves the served model's
    bytes: 2 x layers x KV heads x head_dim values per token, or one MLA latent (kv_lora_rank
    + qk_rope_head_dim) per layer; fp32. Expected values from transformers' config object."""
    from pdcluster.deploy.config import ServeConfig
    from pdcluster.deploy.launcher import conductor_cost_model
    from pdcluster.engine.config import EngineConfig
    from tests.models.factory import build

    hf = build(family, tmp_path / family).config
    if family == "deepseek_v2":
        per_token = hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4
    else:
        head_dim = hf.hidden_size // hf.num_attention_heads
        per_token = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4
    config = ServeConfig(engine=EngineConfig(model=str(tmp_path / family)),
                         cost_model=cost_model)
    cost = conductor_cost_model(config)
    assert cost.kv_bytes_per_token == per_token
    assert cost.t_transfer_tokens(1000) == pytest.approx(
        BUILTIN_COST_MODELS[cost_model].t_transfer(1000 * per_token))
