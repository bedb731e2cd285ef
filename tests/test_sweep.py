"""`ddlscope sweep`: a grid file becomes validated cells (or one line of error), runs through the study
runner, and a rerun reuses the cells already in the store."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddlscope.analysis.summary import Summary
from ddlscope.specs import ConfigError
from ddlscope.studies.base import CellResult
from ddlscope.studies.sweep import load_sweep

pytestmark = pytest.mark.cli_in_this_process  # its runs need no process of their own (conftest.cli)

TINY_WORKLOAD = 'workload = { name = "mlp-digits", steps = 3, batch_size = 32 }'


def _sweep(tmp_path, text: str, name: str = "sweep.toml"):
    path = tmp_path / name
    path.write_text(text)
    return load_sweep(path)


def _error(tmp_path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        _sweep(tmp_path, text)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(tmp_path / "sweep.toml") + ": ")
    return message


# ---------------------------------------------------------------------------- grid -> cells (no process started)
def test_every_combination_of_the_grid_is_a_cell(tmp_path):
    study, cells = _sweep(tmp_path, f"""
name = "g"
[base]
{TINY_WORKLOAD}
[grid]
"strategy.name" = ["ddp", "fsdp"]
"cluster.world_size" = [2, 4]
"workload.lr" = [0.1, 0.05]
""")
    assert study.name == "g" and not study.has_headlines
    assert [c.key for c in cells] == [
        "ddp/world_size=2/lr=0.1", "ddp/world_size=2/lr=0.05", "ddp/world_size=4/lr=0.1", "ddp/world_size=4/lr=0.05",
        "fsdp/world_size=2/lr=0.1", "fsdp/world_size=2/lr=0.05", "fsdp/world_size=4/lr=0.1", "fsdp/world_size=4/lr=0.05"]
    seen = {(c.experiment.strategy.name, c.experiment.cluster.world_size, c.experiment.workload.lr) for c in cells}
    assert seen == {(s, w, lr) for s in ("ddp", "fsdp") for w in (2, 4) for lr in (0.1, 0.05)}
    assert all(c.experiment.workload.steps == 3 and c.experiment.seed == 0 for c in cells)  # the base applies
    assert cells[0].labels["grid"] == {"strategy.name": "ddp", "cluster.world_size": 2, "workload.lr": 0.1}
    assert [c.key for c in _sweep(tmp_path, (tmp_path / "sweep.toml").read_text(), "again.toml")[1]] == \
        [c.key for c in cells]  # stable keys: the same file names the same runs


def test_a_knob_applies_only_to_the_strategies_that_have_it(tmp_path):
    _, cells = _sweep(tmp_path, f"""
name = "k"
[base]
{TINY_WORKLOAD}
strategy = {{ bucket_mb = 5 }}
[grid]
"strategy.name" = ["ddp", "fsdp"]
"strategy.bucket_mb" = [1, 25]
""")
    assert [c.key for c in cells] == ["ddp/bucket_mb=1", "ddp/bucket_mb=25", "fsdp"]
    assert [c.experiment.strategy.bucket_mb for c in cells[:2]] == [1, 25]
    assert "bucket_mb" not in cells[2].experiment.strategy.model_dump()


def test_one_process_cells_run_on_one_rank_and_first(tmp_path):
    _, cells = _sweep(tmp_path, f"""
name = "b"
[base]
{TINY_WORKLOAD}
[grid]
"strategy.name" = ["ddp", "single"]
"cluster.world_size" = [2, 4]
""")
    assert [c.key for c in cells] == ["single", "ddp/world_size=2", "ddp/world_size=4"]
    assert cells[0].experiment.cluster.world_size == 1


def test_repeats_add_seeds_after_the_first_seed_of_every_cell(tmp_path):
    _, cells = _sweep(tmp_path, f"""
name = "r"
repeats = 3
[base]
seed = 7
{TINY_WORKLOAD}
[grid]
"strategy.name" = ["ddp", "fsdp"]
""")
    assert [c.key for c in cells] == ["ddp", "fsdp", "ddp/seed8", "fsdp/seed8", "ddp/seed9", "fsdp/seed9"]
    assert [c.experiment.seed for c in cells] == [7, 7, 8, 8, 9, 9]
    assert {c.labels["group"] for c in cells} == {"ddp", "fsdp"}
    assert [c.labels["seed"] for c in cells] == [0, 0, 8, 8, 9, 9]  # 0: the seed that stands for the cell


def test_a_dict_value_makes_a_readable_key(tmp_path):
    _, cells = _sweep(tmp_path, """
name = "n"
[grid]
"cluster.network" = [{ profile = "fast" }, { profile = "slow", scaled = true }]
""")
    assert [c.key for c in cells] == ['network={"profile":"fast"}', 'network={"profile":"slow","scaled":true}']
    assert cells[1].experiment.cluster.network.scaled and cells[1].labels["network"] == "slow"


@pytest.mark.parametrize("text, expected", [
    ('name = "x"\n[grid]\n"strategy.bukcet_mb" = [1]',
     "cell bukcet_mb=1: strategy.bukcet_mb = 1: unknown field; allowed: batch_split, bucket_mb,"),
    ('name = "x"\n[grid]\n"cluster.world_size" = [2, 0]',
     "cell world_size=0: cluster.world_size = 0: Input should be greater than or equal to 1"),
    ('name = "x"\n[grid]\n"strategy.name" = ["ddp", "nope"]', "cell nope: strategy.name = 'nope': unknown strategy"),
    ('name = "x"\n[base]\nworkload = { batch_size = 64 }\n[grid]\n"cluster.world_size" = [2, 3]',
     "cell world_size=3: workload.batch_size = 64: must be divisible by cluster.world_size = 3"),
    ('name = "x"\n[grid]', "grid: empty; give at least one field"),
    ('name = "x"\n[grid]\n"strategy.name" = []', "grid: 'strategy.name' has no values"),
    ('name = "x"\n[grid]\n"strategy.name" = "ddp"', "grid.strategy.name = 'ddp': Input should be a valid list"),
    ('name = "x"\n[grid]\n"colour" = [1]', "grid: 'colour': not a field of workload, strategy, cluster"),
    ('name = "x"\n[grid]\n"seed" = [1, 2]', "grid: 'seed': seeds come from repeats"),
    ('name = "x"\nrepeats = 0\n[grid]\n"strategy.name" = ["ddp"]', "repeats = 0: Input should be greater than or equal to 1"),
    ('name = "x"\nrepeats = 11\n[grid]\n"strategy.name" = ["ddp"]', "repeats = 11: Input should be less than or equal to 10"),
    ('name = "x"\nrepeats = "3"\n[grid]\n"strategy.name" = ["ddp"]', "repeats = '3': Input should be a valid integer"),
    ('[grid]\n"strategy.name" = ["ddp"]', "name: required, missing"),
    ('name = "a b"\n[grid]\n"strategy.name" = ["ddp"]', "name: 'a b': use letters, digits"),
    ('name = "x"\ncolour = 1\n[grid]\n"strategy.name" = ["ddp"]', "colour = 1: unknown field; allowed: base, grid, name, repeats"),
    ('name = "x"\n[base]\nname = "y"\n[grid]\n"strategy.name" = ["ddp"]', "base: name: the sweep names each cell's run"),
    ('name = "x"\n[grid]\n"cluster.world_size" = [2, 2]', "'cluster.world_size' = [2, 2] lists a value twice"),
])
def test_bad_sweep_is_one_line_naming_what_is_wrong(tmp_path, text, expected):
    assert expected in _error(tmp_path, text)


def test_missing_or_invalid_file_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_sweep(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[grid\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_sweep(tmp_path / "bad.toml")


def test_the_documented_example_is_the_shipped_file_and_is_valid():
    root = Path(__file__).resolve().parents[1]
    example = root / "configs" / "sweep-example.toml"
    assert f"```toml\n{example.read_text()}```" in (root / "docs" / "user-guide.md").read_text()
    _, cells = load_sweep(example)
    assert [c.key for c in cells] == [
        "single", "ddp/world_size=2/bucket_mb=1", "ddp/world_size=2/bucket_mb=25", "ddp/world_size=4/bucket_mb=1",
        "ddp/world_size=4/bucket_mb=25", "fsdp/world_size=2", "fsdp/world_size=4"]  # as the user guide lists them


# ---------------------------------------------------------------------------- analysis
def _result(key, strategy, step_s, accuracy, group=None):
    summary = Summary(
        run={}, steps_recorded=3, ranks_recorded=1, warmup_steps_excluded=1, mean_step_s=step_s,
        throughput_samples_per_s=32 / step_s, baseline_run_id=None, speedup_vs_single=None, scaling_efficiency=None,
        breakdown_mean_s={}, breakdown_fraction={}, comm={}, memory_bytes_by_rank={},
        final_eval={"metric_name": "accuracy", "metric": accuracy}, final_loss=None, train_wall_s=1.0,
        oversubscribed=False, cpu_derived_step_s=step_s, cpu_derived_wall_s=1.0)
    cell = SimpleNamespace(key=key, labels={"strategy": strategy, "group": group or key})
    run = SimpleNamespace(config={"workload": {"name": "mlp-digits"}, "strategy": {"name": strategy}})
    return CellResult(cell, run, summary, reused=False)


def test_analysis_names_the_fastest_and_most_accurate_cells_by_their_seeds_medians(tmp_path):
    study, _ = _sweep(tmp_path, f'name = "a"\nrepeats = 3\n[base]\n{TINY_WORKLOAD}\n[grid]\n"strategy.name" = ["ddp"]')
    results = [_result("single", "single", 0.010, 0.50),
               # ddp's seeds: one fast outlier, median step 20 ms (the baseline's 10 ms: 0.50x)
               _result("ddp", "ddp", 0.030, 0.90), _result("ddp/seed1", "ddp", 0.001, 0.10, "ddp"),
               _result("ddp/seed2", "ddp", 0.020, 0.80, "ddp"),
               _result("fsdp", "fsdp", 0.005, 0.60)]
    findings = study.analyse(results)
    assert findings.headlines == []
    assert findings.decisions == [
        "Highest throughput: fsdp (6400 samples/s, 5.0 ms per step, 2.00x the one-process cell). Next: single. One "
        "seed per cell, so the spread is unknown: set repeats (or --repeats 3) to tell a lead from run-to-run noise.",
        "Highest accuracy: 80.0%, ddp."]
    assert any("3 seeds" in n for n in findings.notes)
    tied = study.analyse([_result("single", "single", 0.010, 0.5), _result("ddp", "ddp", 0.02, 0.5),
                          _result("fsdp", "fsdp", 0.03, 0.4), _result("ssp", "ssp", 0.03, 0.5)])
    assert tied.decisions[1] == "Highest accuracy: 50.0%, single, ddp, ssp."
    same = study.analyse([_result("single", "single", 0.010, 0.5), _result("ddp", "ddp", 0.02, 0.5)])
    assert same.decisions[1] == "Highest accuracy: 50.0%, all 2 cells."


def test_a_lead_within_the_seeds_spread_is_noise_and_a_clear_one_is_a_finding(tmp_path):
    study, _ = _sweep(tmp_path, f'name = "n"\nrepeats = 2\ntarget_accuracy = 0.75\n[base]\n{TINY_WORKLOAD}\n'
                                '[grid]\n"strategy.name" = ["ddp"]')
    seeds = lambda key, strategy, steps, accuracies: [  # noqa: E731
        _result(key if i == 0 else f"{key}/seed{i}", strategy, step, acc, key) for i, (step, acc) in
        enumerate(zip(steps, accuracies))]
    # ddp's median is faster, but its slower seed is slower than fsdp's faster one: noise
    noisy = study.analyse(seeds("ddp", "ddp", (0.010, 0.016), (0.8, 0.8)) + seeds("fsdp", "fsdp", (0.014, 0.015), (0.8, 0.8)))
    assert noisy.decisions[0].startswith("Highest throughput: ddp (")
    assert "Within noise of fsdp: their seeds overlap (ddp 2000-3200, fsdp 2133-2286 samples/s); no winner." \
        in noisy.decisions[0]
    clear = study.analyse(seeds("ddp", "ddp", (0.010, 0.011), (0.8, 0.8)) + seeds("fsdp", "fsdp", (0.014, 0.015), (0.8, 0.8)))
    assert "Ahead of fsdp on every seed (ddp 2909-3200, fsdp 2133-2286 samples/s)." in clear.decisions[0]
    assert clear.decisions[1] == "No cell reached 75% accuracy."  # these cells have no evaluation curve
    # the race to the target: fsdp reaches 75% sooner on both seeds
    raced = seeds("ddp", "ddp", (0.010, 0.011), (0.8, 0.8)) + seeds("fsdp", "fsdp", (0.014, 0.015), (0.8, 0.8))
    for r, reached_s in zip(raced, (3.0, 3.2, 2.0, 2.1)):
        r.cell.labels["target_metric"] = 0.75
        r.summary.eval_curve = [{"wall_s": reached_s / 2, "metric": 0.5}, {"wall_s": reached_s, "metric": 0.8}]
    first = study.analyse(raced).decisions[1]
    assert first == ("First to 75% accuracy: fsdp (2.0 s of training). Ahead of ddp on every seed (fsdp 2-2.1, "
                     "ddp 3-3.2 s).")
    assert "to target s" in study.cell_columns


def test_a_busy_machine_is_named_in_the_notes(tmp_path):
    from ddlscope.studies.sweep import load_notes

    quiet, busy = _result("ddp", "ddp", 0.01, 0.5), _result("fsdp", "fsdp", 0.01, 0.5)
    quiet.run.environment = {"load_average_1m": 0.4, "cores": 2}
    busy.run.environment = {"load_average_1m": 7.0, "cores": 2}
    assert load_notes([quiet]) == []
    (note,) = load_notes([quiet, busy])
    assert note.startswith("The machine was busy: 1 of 2 cells") and "up to 7.0 on 2 cores, at fsdp" in note


# ---------------------------------------------------------------------------- the command
def test_cli_refuses_a_bad_sweep_before_anything_runs(cli, tmp_path):
    (tmp_path / "grid.toml").write_text('name = "x"\n[grid]\n"cluster.world_size" = [2, 0]\n')
    result = cli("sweep", "grid.toml", timeout_s=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "cell world_size=0" in result.stderr
    assert not (tmp_path / "ddlscope.db").exists()


def _runs(db_rows) -> dict[str, tuple]:
    return {name: (run_id, status, json.loads(config)) for run_id, name, status, config in
            db_rows("SELECT id, name, status, config_json FROM runs ORDER BY id")}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def _terminal_cells(stdout: str) -> dict[str, tuple[float, str]]:
    """cell -> (samples/s, speedup) as the sweep's terminal table prints them."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == ["cell", "step", "ms"])
    out = {}
    for line in lines[start + 1:]:
        parts = line.split()
        if not parts or parts[0].startswith("-"):
            break
        out[parts[0]] = (float(parts[2]), parts[3])
    return out


def _page_cells(html: str) -> dict[str, tuple[float, str]]:
    """cell -> (throughput, speedup) as the report's cell table prints them."""
    body = html[html.index("<tbody>"):html.index("</tbody>")]
    out = {}
    for row in re.findall(r"<tr>(.*?)</tr>", body, re.S):
        key = re.search(r'<td class="key">([^<]+)', row).group(1).strip()
        nums = [re.sub(r"<[^>]+>", "", v).strip() for v in re.findall(r'<td class="num">(.*?)</td>', row, re.S)]
        out[key] = (float(nums[1].replace(",", "")), nums[2])  # after the world size
    return out


def test_sweep_runs_its_cells_writes_the_report_and_a_rerun_reuses_them(cli, tmp_path, db_rows):
    grid = tmp_path / "grid.toml"
    text = f'name = "tiny"\n[base]\n{TINY_WORKLOAD}\n[grid]\n"strategy.name" = ["ddp", "single"]\n'
    grid.write_text(text)
    first = cli("sweep", "grid.toml", "-o", "tiny.html")
    assert first.returncode == 0, first.stderr
    assert "sweep tiny: 2 cells (0 reused from the store)" in first.stdout and "headline" not in first.stdout
    assert "Highest throughput:" in first.stdout
    runs = _runs(db_rows)
    assert set(runs) == {"tiny:single", "tiny:ddp"}
    assert all(status == "finished" for _, status, _ in runs.values())
    assert runs["tiny:single"][2]["cluster"]["world_size"] == 1 and runs["tiny:ddp"][2]["cluster"]["world_size"] == 2
    assert runs["tiny:single"][0] < runs["tiny:ddp"][0]  # the baseline first
    html = (tmp_path / "tiny.html").read_text()
    assert "ddlscope sweep tiny" in html and 'id="headlines"' not in html
    assert "tiny:ddp" in html and "tiny:single" in html  # run refs in the cell table

    assert _terminal_cells(first.stdout) == _page_cells(html)  # one computation: the same figures on both

    again = cli("sweep", "grid.toml", "-o", "tiny.html")
    assert again.returncode == 0, again.stderr
    assert "2 cells (2 reused from the store)" in again.stdout
    assert again.stderr.count(": reused") == 2 and _runs(db_rows) == runs

    # A knob only ddp has: the single cell is the same experiment and is reused, the ddp cell is not.
    grid.write_text(text.replace("[grid]", 'strategy = { bucket_mb = 5 }\n[grid]'))
    changed = cli("sweep", "grid.toml", "-o", "tiny.html")
    assert changed.returncode == 0, changed.stderr
    assert "[1/2] single: reused" in changed.stderr and "[2/2] ddp: running" in changed.stderr
    ddp_runs = db_rows("SELECT id, config_json FROM runs WHERE name = 'tiny:ddp' ORDER BY id")
    assert len(ddp_runs) == 2 and json.loads(ddp_runs[1][1])["strategy"]["bucket_mb"] == 5
