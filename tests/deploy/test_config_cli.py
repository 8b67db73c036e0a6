import warnings

import pytest
from pydantic import ValidationError

from pdcluster.deploy.cli import _overrides, _parser, main
from pdcluster.deploy.config import ServeConfig, load_config


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("port: 9000\nengine:\n  block_size: 8\n  dtype: bfloat16\n"
                    "decode_instances: 3\n")
    args = _parser().parse_args(["serve", "--config", str(path), "--block-size", "32",
                                 "--host", "0.0.0.0"])
    cfg = load_config(args.config, _overrides(args))
    assert (cfg.port, cfg.host, cfg.decode_instances) == (9000, "0.0.0.0", 3)
    assert (cfg.engine.block_size, cfg.engine.dtype) == (32, "bfloat16")
    assert cfg.model_name() == "stories260K"
    assert cfg.local_ray_num_cpus() == 1 + 3 + 2


def test_defaults_bind_loopback_and_bad_values_are_rejected(tmp_path):
    cfg = load_config(None, {})
    assert (cfg.host, cfg.port, cfg.kvstore.host) == ("127.0.0.1", 8000, "127.0.0.1")
    with pytest.raises(ValidationError):
        load_config(None, {"prefill_instances": 0})
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  blocksize: 8\n")
    with pytest.raises(ValidationError):
        load_config(bad, {})


def test_prefix_caching_switch():
    on = load_config(None, _overrides(_parser().parse_args(["serve"])))
    off = load_config(None, _overrides(_parser().parse_args(["serve",
                                                             "--no-enable-prefix-caching"])))
    assert on.engine.enable_prefix_caching and not off.engine.enable_prefix_caching


def test_kv_load_failure_policy_flag():
    def policy(*flags):
        return load_config(None, _overrides(_parser().parse_args(["serve", *flags]))
                           ).transfer.load_failure_policy

    assert policy() == "recompute"
    assert policy("--kv-load-failure-policy", "fail") == "fail"
    with pytest.raises(ValidationError):
        policy("--kv-load-failure-policy", "ignore")


def test_enforce_eager_switch_and_the_device_default():
    def engine(*flags):
        return load_config(None, _overrides(_parser().parse_args(["serve", *flags]))).engine

    default, eager, compiled = engine(), engine("--enforce-eager"), engine("--no-enforce-eager")
    assert (default.enforce_eager, eager.enforce_eager, compiled.enforce_eager) == (None, True, False)
    assert default.eager() and eager.eager() and not compiled.eager()
    assert not default.model_copy(update={"device": "cuda"}).eager()
    assert eager.model_copy(update={"device": "cuda"}).eager()


def test_api_keys_from_flags_and_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("k3\n")
    args = _parser().parse_args(["serve", "--api-key", "k1", "--api-key", "k2",
                                 "--api-key-file", str(path)])
    cfg = load_config(None, _overrides(args))
    assert [k.get_secret_value() for k in cfg.api_keys] == ["k1", "k2"]
    assert "k1" not in repr(cfg) and cfg.api_key_file == str(path)


def test_conductor_flags():
    default = load_config(None, {})
    assert (default.policy, default.admission, default.slo_ttft_s, default.slo_tbt_ms,
            default.cost_model) == ("kvcache_centric", "none", 30.0, 100.0, "stories260k-cpu")
    args = _parser().parse_args(["serve", "--policy", "cache_aware", "--admission", "prediction",
                                 "--slo-ttft-s", "2.5", "--slo-tbt-ms", "50",
                                 "--cost-model", "mooncake-70b"])
    cfg = load_config(None, _overrides(args))
    assert (cfg.policy, cfg.admission, cfg.slo_ttft_s, cfg.slo_tbt_ms, cfg.cost_model) == \
        ("cache_aware", "prediction", 2.5, 50.0, "mooncake-70b")
    for bad in ({"policy": "fastest"}, {"admission": "always"}, {"slo_ttft_s": 0}):
        with pytest.raises(ValidationError):
            load_config(None, bad)


# ---- one source per setting ------------------------------

def _serve(*flags: str):
    return load_config(None, _overrides(_parser().parse_args(["serve", *flags])))


def test_tensor_parallel_size_sets_every_role_and_the_role_flags_override_it():
    default = _serve()
    assert (default.prefill_engine().tensor_parallel_size,
            default.decode_engine().tensor_parallel_size) == (1, 1)
    both = _serve("--tensor-parallel-size", "2")
    assert both.engine.tensor_parallel_size == 2 and both.prefill_tp is None
    assert (both.prefill_engine().tensor_parallel_size,
            both.decode_engine().tensor_parallel_size) == (2, 2)
    one = _serve("--tensor-parallel-size", "2", "--decode-tp", "4")
    assert (one.prefill_engine().tensor_parallel_size,
            one.decode_engine().tensor_parallel_size) == (2, 4)
    assert one.local_ray_num_cpus() == 1 * 2 + 1 * 4 + 2
    roles = ServeConfig(prefill_tp=2, decode_tp=3)  # the Python API, as the TP tests use it
    assert (roles.prefill_engine().tensor_parallel_size,
            roles.decode_engine().tensor_parallel_size) == (2, 3)
    assert roles.engine.tensor_parallel_size == 1  # the shared engine is not touched
    with pytest.raises(ValidationError):
        _serve("--prefill-tp", "0")


@pytest.mark.parametrize(("flags", "layout"), [
    ((), "layer"),
    (("--kv-transfer", "mooncake"), "cross-layer"),  # TE prefers whole blocks
    (("--kv-transfer", "mooncake", "--kv-streaming", "layer"), "layer"),  # streams per layer
    (("--kv-transfer", "mooncake", "--colocated"), "layer"),  # nothing moves
    (("--kv-transfer", "torch"), "layer"),
    (("--kv-transfer", "mooncake", "--kv-cache-layout", "layer"), "layer"),
    (("--kv-cache-layout", "cross-layer"), "cross-layer"),
])
def test_the_kv_cache_layout_follows_the_connector_unless_set(flags, layout):
    config = _serve(*flags)
    assert config.prefill_engine().kv_cache_layout == layout
    assert config.decode_engine().kv_cache_layout == layout


@pytest.mark.parametrize(("flags", "window"), [
    ((), 0),  # LRU order, as vLLM
    (("--kv-transfer", "mooncake"), 2),  # a cross-layer cache: runs of blocks, one read each
    (("--kv-transfer", "mooncake", "--block-run-window", "0"), 0),
    (("--block-run-window", "8"), 8),
])
def test_the_block_run_window_follows_the_cache_layout_unless_set(flags, window):
    config = _serve(*flags)
    assert config.prefill_engine().resolved_block_run_window() == window
    assert config.decode_engine().resolved_block_run_window() == window
    with pytest.raises(ValidationError):
        _serve("--block-run-window", "-1")


def test_kv_flags_set_the_fields_they_name():
    cfg = _serve("--kv-tail-capacity-bytes", "4096", "--kv-token", "t0k3n")
    assert cfg.kvstore.tail_capacity_bytes == 4096
    assert cfg.kvstore.token.get_secret_value() == "t0k3n"


def test_names_that_never_shipped_are_refused_with_the_key_named(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text("kvstore:\n  capacity_bytes: 4096\n")
    with pytest.raises(ValidationError, match="capacity_bytes"):
        load_config(path, {})
    assert main(["serve", "--config", str(path)]) != 0
    assert "capacity_bytes" in capsys.readouterr().err


def test_new_keys_load_without_warnings(tmp_path):
    path = tmp_path / "new.yaml"
    path.write_text("kvstore:\n  tail_capacity_bytes: 4096\n  rpc_timeout_s: 3\n"
                    "  max_message_bytes: 1048576\n"
                    "engine:\n  tensor_parallel_size: 2\ndecode_tp: 1\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(path, {})
    assert (cfg.kvstore.tail_capacity_bytes, cfg.kvstore.rpc_timeout_s,
            cfg.kvstore.max_message_bytes) == (4096, 3.0, 1 << 20)
    assert (cfg.prefill_engine().tensor_parallel_size,
            cfg.decode_engine().tensor_parallel_size) == (2, 1)


def test_a_model_or_quantization_not_served_fails_before_ray_starts(tmp_path, capsys):
    """Checked at start, with the reason, exit status 2: no Ray, no worker."""
    assert main(["serve", "--quantization", "fp8"]) == 2
    assert "no quantization_config" in capsys.readouterr().err
    assert main(["serve", "--quantization", "awq"]) == 2
    assert "'awq' is not supported; supported: compressed-tensors, fp8" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err
