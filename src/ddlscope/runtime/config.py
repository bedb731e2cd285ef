"""Experiments from TOML files and command-line overrides, validated before anything starts.

Plugin knobs live in each plugin's own spec class, so this is the one place
that resolves `workload.name` / `strategy.name` through the registries.
Everything that goes wrong here is a ConfigError with a one-line message.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ddlscope.specs.registry import Registry, UnknownPluginError
from ddlscope.specs import ClusterSpec, ConfigError, Experiment, check_consistency, describe_validation_error
from ddlscope.specs import STRATEGY_SPECS
from ddlscope.workloads import WORKLOADS

DEFAULT_WORKLOAD = "mlp-digits"
DEFAULT_STRATEGY = "ddp"
TOP_LEVEL = ("name", "seed", "save_model_path", "checkpoint_dir", "checkpoint_every", "checkpoint_every_s",
             "trace_steps")
SECTIONS = (*TOP_LEVEL, "workload", "strategy", "cluster")
# The sections whose knobs depend on the plugin `name` picks: its registry and default name.
PLUGIN_SECTIONS: dict[str, tuple[Registry[Any], str]] = {
    "workload": (WORKLOADS, DEFAULT_WORKLOAD), "strategy": (STRATEGY_SPECS, DEFAULT_STRATEGY)}


def load_experiment(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Experiment:
    """Read a TOML file (optional), apply dotted overrides, validate everything."""
    raw = read_toml(path) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    return experiment_from_dict(raw)


# A config file is a few kB; past this it is not one (and reading it whole would take the memory).
MAX_CONFIG_BYTES = 16 * 2**20


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"config file {path} is a symbolic link that loops; give the TOML file") from None
        if path.is_symlink():
            raise ConfigError(f"config file {path} is a symbolic link to {os.readlink(path)}, which does not "
                              "exist") from None
        if exc.errno == errno.ENOENT:
            raise ConfigError(f"config file {path} does not exist") from None
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    if stat.S_ISDIR(mode):
        raise ConfigError(f"config file {path} is a folder: give the TOML file in it")
    if not stat.S_ISREG(mode):
        # A FIFO would block the read forever, /dev/zero would never end it.
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file"
        raise ConfigError(f"config file {path} is {kind}: give a TOML file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} holds {path.stat().st_size:,} bytes, more than a config's "
                          f"{MAX_CONFIG_BYTES:,}: give the TOML file")
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def parse_override(item: str) -> tuple[str, Any]:
    """`strategy.bucket_mb=5` -> ("strategy.bucket_mb", 5). Values are TOML literals, else strings."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. strategy.bucket_mb=5")
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return key.strip(), value


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if parts[0] not in SECTIONS:
        raise ConfigError(f"{dotted} = {value!r}: unknown section {parts[0]!r}; allowed: {', '.join(SECTIONS)}")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted} = {value!r}: {part} is not a table")
        node = child
    node[parts[-1]] = value


def experiment_from_dict(raw: dict[str, Any], check_workload: bool = True) -> Experiment:
    """The validated experiment. `check_workload` also lets the workload refuse what its fields alone
    cannot tell (a `torchvision:NAME` torchvision lacks): a meta-device build, skipped where the
    experiment was checked already (a rank reading the launcher's JSON)."""
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]} = {raw[unknown[0]]!r}: unknown field; allowed: {', '.join(SECTIONS)}")
    workload = _plugin_spec(WORKLOADS, "workload", raw.get("workload", {}), DEFAULT_WORKLOAD)
    strategy = _plugin_spec(STRATEGY_SPECS, "strategy", raw.get("strategy", {}), DEFAULT_STRATEGY)
    cluster = _validate(ClusterSpec, raw.get("cluster", {}), "cluster")
    top = {k: raw[k] for k in TOP_LEVEL if k in raw}
    try:
        exp = Experiment(workload=workload, strategy=strategy, cluster=cluster, **top)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err)) from None
    check_consistency(exp)
    if check_workload:
        _check_workload(exp)
    return exp


def _check_workload(exp: Experiment) -> None:
    """What only the built model can tell: the workload's own checks, and whether the strategy can
    hold the model (its runtime class's `check_model`, on the meta device, where the workload builds
    its model alone)."""
    workload = WORKLOADS.get(exp.workload.name)
    workload.validate(exp.workload)
    model = workload.meta_model(exp.workload)
    if model is not None:
        # Imported here: the strategies pull in torch.distributed's FSDP, pipelining and DTensor, a
        # second of start-up that a command reading the config of a built-in workload never needs.
        from ddlscope.strategies import runtime_class

        runtime_class(exp.strategy).check_model(exp.strategy, model)


def experiment_from_json(text: str) -> Experiment:
    return experiment_from_dict(json.loads(text), check_workload=False)


def experiment_to_dict(exp: Experiment) -> dict[str, Any]:
    return exp.model_dump(mode="json")


def plugin_spec_class(section: str, name: str | None) -> type[BaseModel] | None:
    """The spec class of the workload or strategy `name` (the section's default for None), None if unknown."""
    registry, default = PLUGIN_SECTIONS[section]
    if (name or default) not in registry:
        return None
    plugin = registry.get(name or default)
    return getattr(plugin, "spec_class", plugin)


def _plugin_spec(registry: Registry[Any], section: str, raw: Any, default: str) -> BaseModel:
    if not isinstance(raw, dict):
        raise ConfigError(f"{section} = {raw!r}: must be a table")
    raw = {"name": default, **raw}
    try:
        plugin = registry.get(str(raw["name"]))
    except UnknownPluginError as err:
        raise ConfigError(f"{section}.name = {err.name!r}: unknown {section}; allowed: {', '.join(err.known)}") from None
    # Workload plugins carry their spec class; the strategy registry holds the spec classes themselves.
    return _validate(getattr(plugin, "spec_class", plugin), raw, section)


def _validate(model: type[BaseModel], raw: Any, section: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{section} = {raw!r}: must be a table")
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err, prefix=section)) from None
