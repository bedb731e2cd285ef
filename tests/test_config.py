"""Specs from TOML and overrides; cross-section checks."""

import pytest

from ddlscope.runtime.config import load_experiment, parse_override
from ddlscope.specs import ConfigError


def test_defaults_need_no_file():
    exp = load_experiment()
    assert exp.workload.name == "mlp-digits" and exp.strategy.name == "ddp" and exp.cluster.world_size == 2


def test_file_then_flags(tmp_path):
    cfg = tmp_path / "e.toml"
    cfg.write_text('seed = 4\n[workload]\nname = "gpt-char"\nlayers = 3\n[strategy]\nname = "ddp"\nbucket_mb = 1\n'
                   '[cluster]\nworld_size = 4\n')
    exp = load_experiment(cfg, dict([parse_override("strategy.bucket_mb=5"), parse_override("cluster.world_size=2")]))
    assert exp.seed == 4 and exp.workload.layers == 3 and exp.strategy.bucket_mb == 5
    assert exp.cluster.world_size == 2 and exp.per_rank_batch() == exp.workload.batch_size // 2


def test_override_values_are_toml_literals():
    assert parse_override("a.b=5") == ("a.b", 5)
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a.b=fp16") == ("a.b", "fp16")  # bare words stay strings
    with pytest.raises(ConfigError):
        parse_override("novalue")


def test_powersgd_shorthand_sets_rank():
    exp = load_experiment(None, {"strategy.comm_hook": "powersgd(4)"})
    assert exp.strategy.comm_hook == "powersgd" and exp.strategy.powersgd_rank == 4


@pytest.mark.parametrize("overrides, fragment", [
    ({"cluster.slowdown": [1, 2, 3]}, "one per rank"),
    ({"cluster.slowdown": [1, 0.5]}, ">= 1"),
    ({"cluster.nnodes": 2, "cluster.world_size": 4}, "rdzv_endpoint"),
    ({"cluster.nnodes": 3, "cluster.world_size": 4, "cluster.rdzv_endpoint": "h:1"}, "multiple of nnodes"),
    ({"cluster.rdzv_endpoint": "nohost"}, "host:port"),
    ({"cluster.faults": [{"rank": 5, "step": 1}]}, "outside"),
    ({"workload.name": "gpt-char", "workload.hidden": 130}, "heads"),
    ({"workload.name": "mlp-digits", "workload.layers": 0}, "workload.layers"),
])
def test_inconsistent_input_is_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        load_experiment(None, overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_strategy_knobs_do_not_leak_between_strategies():
    with pytest.raises(ConfigError, match="strategy.bucket_mb"):
        load_experiment(None, {"strategy.name": "single", "strategy.bucket_mb": 5, "cluster.world_size": 1})
