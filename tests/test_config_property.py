"""Property tests: whatever a config file or `--set` holds, the loader answers with an experiment or a
ConfigError (one line, exit 2 on the command line), never another exception (a traceback)."""

from __future__ import annotations

import string
import tomllib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddlscope.runtime.config import SECTIONS, load_experiment, parse_override
from ddlscope.specs import ConfigError

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Keys a user might type: the real ones (so that values reach the validators), and near misses.
REAL_KEYS = ["name", "seed", "save_model_path", "checkpoint_dir", "trace_steps", "workload.name", "workload.batch_size",
             "workload.steps", "workload.lr", "workload.momentum", "workload.eval_every", "workload.optimizer",
             "workload.hidden", "workload.heads", "workload.layers", "workload.seq_len", "strategy.name",
             "strategy.bucket_mb", "strategy.comm_hook", "cluster.world_size", "cluster.nnodes", "cluster.node_rank",
             "cluster.rdzv_endpoint", "cluster.slowdown", "cluster.start_delay_s", "cluster.jitter", "cluster.faults",
             "cluster.network", "cluster.network.profile", "cluster.network.alpha_us", "cluster.network.bandwidth_gbps",
             "workload", "strategy", "cluster"]
WORKLOADS = ["mlp-digits", "cnn-digits", "gpt-char", "gpt-synthetic", "nope", ""]
STRATEGIES = ["single", "ddp", "fsdp", "ps-sync", "ps-async", "ssp", "nope", ""]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-3, max_value=70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(WORKLOADS + STRATEGIES + ["local", "fast", "custom", "crash", "fp16", "[/]", "<b>"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)
keys = st.one_of(st.sampled_from(REAL_KEYS), st.text(alphabet=string.ascii_lowercase + "._", max_size=20),
                 st.text(max_size=10))


def _refused_or_valid(call) -> None:
    try:
        call()
    except ConfigError as exc:
        assert str(exc).strip(), "a ConfigError says what is wrong"


@SETTINGS
@given(st.dictionaries(keys, values, max_size=5))
def test_any_overrides_are_an_experiment_or_a_config_error(overrides):
    _refused_or_valid(lambda: load_experiment(None, overrides))


@SETTINGS
@given(st.lists(st.one_of(st.text(max_size=30),
                          st.builds(lambda k, v: f"{k}={v}", st.sampled_from(REAL_KEYS),
                                    st.one_of(st.text(max_size=15), st.integers().map(str),
                                              st.floats().map(repr), st.sampled_from(
                                                  ["inf", "nan", "-inf", "1e99", "[1,", "{a=1}", "true", '"x"',
                                                   "[1, 2]", "{rank = 0, step = 1}", "0x10", "1_000"])))),
                max_size=4))
def test_any_set_items_are_an_experiment_or_a_config_error(items):
    def load():
        overrides = dict(parse_override(item) for item in items)
        return load_experiment(None, overrides)

    _refused_or_valid(load)


@SETTINGS
@given(st.one_of(st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
                 st.text(max_size=200),
                 st.dictionaries(st.sampled_from([*SECTIONS, "nope"]), values, max_size=4).map(repr)))
def test_any_toml_text_is_an_experiment_or_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("cfg") / "exp.toml"
    path.write_bytes(text.encode("utf-8", "surrogatepass") if text else b"")
    _refused_or_valid(lambda: load_experiment(path))


@SETTINGS
@given(st.dictionaries(st.sampled_from(["workload", "strategy", "cluster"]),
                       st.dictionaries(st.sampled_from(["name", "batch_size", "steps", "lr", "world_size", "nnodes",
                                                        "bucket_mb", "network", "slowdown", "faults", "heads",
                                                        "hidden", "comm_hook", "profile"]),
                                       values, max_size=4), max_size=3),
       st.sampled_from(WORKLOADS), st.sampled_from(STRATEGIES))
def test_any_toml_tables_are_an_experiment_or_a_config_error(tmp_path_factory, tables, workload, strategy):
    """Valid TOML whose tables hold random values: what the validators (not the parser) must refuse."""
    lines = []
    tables.setdefault("workload", {}).setdefault("name", workload)
    tables.setdefault("strategy", {}).setdefault("name", strategy)
    for section, body in tables.items():
        lines.append(f"[{section}]")
        for key, value in body.items():
            lines.append(f"{key} = {_toml(value)}")
    text = "\n".join(lines) + "\n"
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return  # a value TOML cannot write (None): the parser's case, covered above
    path = tmp_path_factory.mktemp("cfg") / "exp.toml"
    path.write_text(text)
    _refused_or_valid(lambda: load_experiment(path))


def _toml(value) -> str:
    if value is None:
        return "nope nope"  # not TOML: skipped
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if value != value else ("inf" if value == float("inf") else
                                             "-inf" if value == float("-inf") else repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return '"' + value.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f'"{k}" = {_toml(v)}' for k, v in value.items()) + "}"
