"""Cost models: the built-in mooncake-70b constants, files, and `pdcluster profile` fits."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from deploy.profile import add_profile_parser, fit_nonnegative, run_profile
from router.cost_model import (BUILTIN_COST_MODELS, MOONCAKE_70B, CostModel, load_cost_model,
                               save_cost_model)


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
