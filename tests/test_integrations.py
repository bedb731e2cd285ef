"""The Hugging Face Trainer and Lightning callbacks, each on a tiny model at 2 processes under
`ddlscope launch`: every optimizer step is a stored row whose parts add up, with the trainer's loss."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.multiprocess

STEPS, BATCH = 4, 4

HF_SCRIPT = f'''
import torch
from torch import nn
# This machine's PyPI torchvision cannot load its operators beside the CPU torch, and transformers would
# import it: ddlscope's import of transformers keeps it away (workloads/sources.py).
from ddlscope.workloads.sources import import_transformers
import_transformers()
from transformers import Trainer, TrainingArguments
from ddlscope.runtime.integrations import hf_trainer_callback


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {{"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}}


g = torch.Generator().manual_seed(0)
data = [{{"x": torch.randn(8, generator=g), "labels": torch.tensor(i % 2)}} for i in range(64)]
args = TrainingArguments(output_dir="out", max_steps={STEPS}, per_device_train_batch_size={BATCH}, use_cpu=True,
                         report_to=[], save_strategy="no", logging_strategy="no", dataloader_num_workers=0,
                         disable_tqdm=True)
Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=[hf_trainer_callback(run="hf")]).train()
'''

LIGHTNING_SCRIPT = f'''
import torch
from torch import nn
# Lightning's metrics import torchvision, whose PyPI wheel cannot load its operators beside the CPU torch
# here: ddlscope's import of it defines the two operator schemas it needs (workloads/sources.py).
from ddlscope.workloads.sources import import_torchvision
import_torchvision()
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
from ddlscope.runtime.integrations import lightning_callback


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.arange(64) % 2)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps={STEPS}, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[lightning_callback(run="lightning")])
trainer.fit(Tiny(), DataLoader(data, batch_size={BATCH}))
'''


@pytest.mark.timeout(300)
@pytest.mark.parametrize("library,script,strategy", [
    ("transformers", HF_SCRIPT, "own"),  # the callback sees the Trainer's model, not accelerate's DDP wrapper
    ("lightning", LIGHTNING_SCRIPT, "ddp"),  # Lightning's strategy hands over its DDP wrapper
])
def test_a_trainer_callback_stores_every_step(library: str, script: str, strategy: str, tmp_path: Path) -> None:
    if importlib.util.find_spec(library) is None:  # not imported here: the script imports it, in its ranks
        pytest.skip(f"{library} is not installed (pip install -e '.[test]')")
    (tmp_path / "train.py").write_text(script)
    done = run_cli("launch", "--nproc", "2", "--json", "train.py", cwd=tmp_path, timeout_s=280)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["run"]["status"] == "finished" and summary["run"]["strategy"] == strategy
    assert summary["run"]["workload"] == "attached:Tiny"
    with sqlite3.connect(tmp_path / "ddlscope.db") as conn:
        rows = conn.execute("SELECT rank, step, data_s + forward_s + backward_s + comm_wait_s + optimizer_s, step_s,"
                            " forward_s, backward_s, samples, loss FROM steps ORDER BY rank, step").fetchall()
    assert [(r[0], r[1]) for r in rows] == [(rank, s) for rank in (0, 1) for s in range(STEPS)]
    for _, _, parts, step_s, forward_s, backward_s, samples, loss in rows:
        assert parts == pytest.approx(step_s, rel=1e-9)
        assert forward_s > 0 and backward_s > 0 and samples == BATCH
        assert 0.1 < loss < 5  # cross-entropy of 2 classes from a random start: about ln 2
