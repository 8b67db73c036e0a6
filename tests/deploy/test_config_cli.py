import pytest
from pydantic import ValidationError

from deploy.cli import _overrides, _parser
from deploy.config import load_config


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
