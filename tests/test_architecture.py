"""The architecture holds: imports go one way, the torch-free layers stay torch-free, and every
registered strategy is whole (spec, runtime class, estimator at both scales, docs, advice)."""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SRC

PACKAGE = SRC / "ddlscope"
DOCS = SRC.parent / "docs"
# Higher uses lower, never the other way (docs/architecture.md draws the same picture).
LAYERS = {"cli": 9, "__main__": 9, "studies": 8, "report": 7, "advise": 6, "memory_estimate": 6, "analysis": 5, "predict": 5,
          "calibrate": 4, "runtime": 3, "strategies": 2, "workloads": 1, "specs": 0, "store": 0, "__init__": 0}
TORCH_FREE = ("ddlscope.specs", "ddlscope.predict", "ddlscope.analysis", "ddlscope.report", "ddlscope.advise",
              "ddlscope.memory_estimate",
              "ddlscope.calibrate.model", "ddlscope.calibrate.profile")


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1].removesuffix(".py") if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[str]:
    """Every ddlscope module `path` imports, at module level or inside a function; except the package's
    public API, which its `__init__` imports lazily in `__getattr__` (a facade over the layers)."""
    found = []
    tree = ast.parse(path.read_text())
    if path.name == "__init__.py" and path.parent == PACKAGE:
        tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == "__getattr__")]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddlscope"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("ddlscope")]
    return found


def _modules() -> list[tuple[str, Path]]:
    return [(".".join(p.relative_to(SRC).with_suffix("").parts), p) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_module_belongs_to_a_layer():
    assert {_layer(m) for m, _ in _modules()} <= set(LAYERS), "a new top-level module needs a layer"


def test_no_module_imports_a_layer_above_its_own():
    upward = [f"{module} imports {target}" for module, path in _modules() for target in _imports(path)
              if LAYERS[_layer(target)] > LAYERS[_layer(module)]]
    assert not upward, "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ddlscope.cli import app\n")
    assert any(LAYERS[_layer(t)] > LAYERS["specs"] for t in _imports(bad))


@pytest.mark.parametrize("package", TORCH_FREE)
def test_torch_free_layers_never_import_torch(package: str):
    code = (f"import sys, pkgutil, importlib, {package} as p\n"
            "for m in pkgutil.walk_packages(getattr(p, '__path__', []), p.__name__ + '.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.'))[:3])")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{package} pulled in {out.stdout.strip()}"


# ---------------------------------------------------------------------------- the strategy contract
def _specs():
    from ddlscope.specs import strategy_specs

    return strategy_specs()


def _cluster_case():
    from ddlscope.predict.catalogue import parse_cluster
    from ddlscope.predict.estimators import ClusterCase
    from ddlscope.predict.strategies import ServerSpec, Workload

    cluster = parse_cluster("a100-80gb:2x8")
    workload = Workload(name="w", params=1e8, flops_per_sample=6e9, batch_per_worker=8,
                        activation_bytes_per_sample=1e7, layers=12)
    return ClusterCase(workload=workload, cluster=cluster, stragglers=1.0, slowdowns=None, server=ServerSpec(),
                       activation_bytes=8e7, weight_bytes_per_param=4.0, optimizer_bytes_per_param=8.0)


def _local_prediction(spec_class):
    from test_regression_numbers import FACTS, PROFILE

    from ddlscope.predict.local import predict_local

    world = 1 if spec_class.traits.single_process else 2
    config = {"workload": {"name": "mlp-digits"}, "strategy": spec_class().model_dump(),
              "cluster": {"world_size": world}}
    return predict_local(config, {}, FACTS, PROFILE)


def test_the_registry_holds_the_strategies_of_the_main_study():
    from ddlscope.specs import STRATEGY_SPECS

    assert {"single", "ddp", "fsdp", "ps-sync", "ps-async", "ssp", "ps-stale-aware"} <= set(STRATEGY_SPECS.names())


@pytest.mark.parametrize("spec_class", _specs(), ids=lambda c: c.__name__)
def test_every_strategy_is_whole(spec_class):
    from ddlscope.predict.estimators import ESTIMATORS
    from ddlscope.strategies import RUNTIMES, Strategy

    name = spec_class.registered_name
    assert spec_class.description.strip() and spec_class.advice.strip(), f"{name}: description and advice"
    runtime = RUNTIMES.find(spec_class)
    assert runtime is not None and issubclass(runtime, Strategy), f"{name} has no runtime class"
    assert ESTIMATORS.find(spec_class) is not None, f"{name} has no estimator"
    assert f"| `{name}` |" in (DOCS / "strategies.md").read_text(), f"{name} has no row in docs/strategies.md"


@pytest.mark.parametrize("spec_class", _specs(), ids=lambda c: c.__name__)
def test_every_estimator_prices_its_strategy_at_both_scales(spec_class):
    from ddlscope.predict.estimators import estimator_for

    spec, case = spec_class(), _cluster_case()
    estimator = estimator_for(spec)
    estimate = estimator.cluster(spec, case)
    memory, _server = estimator.cluster_memory(spec, case)
    assert 0 < estimate.compute_s <= estimate.step_s < math.inf
    assert memory >= case.activation_bytes
    local = _local_prediction(spec_class)
    assert 0 < local["step_s"] < math.inf and local["model_state_bytes"] > 0


def test_a_strategy_without_an_estimator_is_caught():
    from typing import Literal

    from ddlscope.predict.estimators import ESTIMATORS
    from ddlscope.specs import StrategySpec, Traits

    class OrphanSpec(StrategySpec):
        traits = Traits(family="collective", simplicity=99)
        description = advice = "x"
        name: Literal["orphan"] = "orphan"

    assert ESTIMATORS.find(OrphanSpec) is None
    with pytest.raises(LookupError, match="no estimator is registered for OrphanSpec"):
        ESTIMATORS.get(OrphanSpec)


def test_the_user_guide_lists_every_command_and_built_in_workload():
    # the lists a reader relies on cannot go stale: every registered command and workload has its row
    import re

    from ddlscope.cli import COMMANDS
    from ddlscope.workloads import WORKLOADS

    guide = (DOCS / "user-guide.md").read_text()
    rows = "\n".join(line for line in guide.splitlines() if line.startswith("| `ddlscope"))
    commands = [name for name, _ in COMMANDS if not re.search(rf"`ddlscope {re.escape(name)}[ `]", rows)]
    assert not commands, f"docs/user-guide.md's command table lacks {commands}"
    workloads = [name for name in WORKLOADS.names() if ":" not in name and f"| `{name}` |" not in guide]
    assert not workloads, f"docs/user-guide.md's workload table lacks {workloads} (model sources: docs/models.md)"
