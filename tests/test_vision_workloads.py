"""Vision workloads: the synthetic CIFAR-like data (deterministic, balanced, learnable by a CNN
and not by a linear model), the FLOPs-per-parameter regime of ResNet-50 on CIFAR-10, a 2-rank run."""

from __future__ import annotations

import time

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ddlscope.runtime.profiler import profile_step, profile_task
from ddlscope.workloads import WORKLOADS, Task
from ddlscope.workloads.base import cross_entropy
from ddlscope.workloads.vision import ResnetCifarSpec, VggCifarSpec, _generate_synthetic_cifar, synthetic_cifar

pytestmark = pytest.mark.cli_in_this_process  # its runs need no process of their own (conftest.cli)

SMALL = {"samples": 4000, "test_samples": 1000}


def build(name: str, seed: int = 0, **knobs: object) -> Task:
    workload = WORKLOADS.get(name)
    return workload.build(workload.spec_class(**knobs), seed)


# --- the data -------------------------------------------------------------------------------------


def test_data_is_a_function_of_the_seed() -> None:
    a, b, c = synthetic_cifar(3, 200, 50), synthetic_cifar(3, 200, 50), synthetic_cifar(4, 200, 50)
    synthetic_cifar.cache_clear()
    fresh = synthetic_cifar(3, 200, 50)  # rebuilt, not the cached tensors: what another rank computes
    for x, y, z in zip(a, fresh, b):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[2], c[2])
    # the test split does not depend on how many training images there are
    assert torch.equal(synthetic_cifar(3, 300, 50)[2], a[2])


def test_generated_data_is_cached_on_disk_and_regenerated_when_the_cache_is_bad(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DDLSCOPE_CACHE_DIR", str(tmp_path))
    synthetic_cifar.cache_clear()
    first = synthetic_cifar(5, 120, 30)
    files = list(tmp_path.glob("synthetic-cifar-*-5-120-30.pt"))
    assert len(files) == 1 and not list(tmp_path.glob(".*"))  # no temporary file left behind
    synthetic_cifar.cache_clear()
    loaded = synthetic_cifar(5, 120, 30)  # from the file
    assert all(torch.equal(a, b) for a, b in zip(first, loaded))
    files[0].write_bytes(files[0].read_bytes()[:100])  # truncated: generated again, and rewritten
    synthetic_cifar.cache_clear()
    again = synthetic_cifar(5, 120, 30)
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and files[0].stat().st_size > 100
    monkeypatch.setenv("DDLSCOPE_CACHE_DIR", str(tmp_path / "file-not-folder"))
    (tmp_path / "file-not-folder").write_text("")  # unwritable cache: still the same data
    synthetic_cifar.cache_clear()
    assert all(torch.equal(a, b) for a, b in zip(first, synthetic_cifar(5, 120, 30)))
    synthetic_cifar.cache_clear()


def test_shapes_and_balanced_classes() -> None:
    x_train, y_train, x_test, y_test = synthetic_cifar(0, 1000, 200)
    assert x_train.shape == (1000, 3, 32, 32) and x_test.shape == (200, 3, 32, 32)
    assert x_train.dtype == torch.uint8 and y_train.dtype == torch.int64
    assert torch.equal(torch.bincount(y_train), torch.full((10,), 100))
    assert torch.equal(torch.bincount(y_test), torch.full((10,), 20))
    task = build("resnet-cifar", **SMALL)
    x, y = task.train.get(torch.arange(8))
    assert x.dtype == torch.float32 and x.shape == (8, 3, 32, 32) and abs(x.mean().item()) < 0.5
    assert task.model(x).shape == (8, 10) and build("vgg-cifar", **SMALL).model(x).shape == (8, 10)
    assert build("convnext-cifar", **SMALL).model(x).shape == (8, 10)


def test_default_size_generates_fast() -> None:
    spec = ResnetCifarSpec()
    # CPU time, not wall (a CI run beside other work took 4.65 s of wall): about 1.3 s of wall on an idle
    # 2-core machine, 3.5 s of CPU over torch's two threads at load 3.5; what this guards against is a
    # generator gone several times slower
    start = time.process_time()
    _generate_synthetic_cifar(11, spec.samples, spec.test_samples)  # without the file cache
    assert time.process_time() - start < 8.0
    synthetic_cifar.cache_clear()


def test_builds_under_the_meta_device_keep_real_data() -> None:
    with torch.device("meta"):
        task = build("resnet-cifar", **SMALL)
    assert next(task.model.parameters()).device.type == "meta"
    assert task.train.get(torch.arange(2))[0].device.type == "cpu"


def test_same_seed_same_model_different_seed_different_model() -> None:
    for name in ("resnet-cifar", "vgg-cifar"):
        a, b, c = build(name, 5, **SMALL), build(name, 5, **SMALL), build(name, 6, **SMALL)
        assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))
        assert any(not torch.equal(p, q) for p, q in zip(a.model.parameters(), c.model.parameters()))
        assert not list(a.model.buffers())  # GroupNorm: no per-rank running statistics


def _linear_accuracy(task: Task, train: int = 2000) -> float:
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x, y = task.train.get(torch.arange(train))
    xt, yt = task.test.get(torch.arange(len(task.test)))
    scaler = StandardScaler().fit(x.flatten(1).numpy())
    model = LogisticRegression(C=1e-3, max_iter=100).fit(scaler.transform(x.flatten(1).numpy()), y.numpy())
    return float(model.score(scaler.transform(xt.flatten(1).numpy()), yt.numpy()))


def _cnn_accuracy(task: Task, steps: int, batch: int = 32, lr: float = 2e-3) -> float:
    model = task.model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    order = torch.randperm(len(task.train), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        x, y = task.train.get(order[(step * batch) % len(order):][:batch])
        loss = task.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return task.evaluate(model, torch.device("cpu")).metric


def test_a_cnn_learns_what_a_linear_model_cannot() -> None:
    torch.set_num_threads(2)
    # resnet-cifar's architecture at width 8, one block per stage (78k parameters, a tenth of the
    # default's FLOPs) so the test stays short: 150 steps reach about 0.94, logistic regression about 0.27.
    task = build("resnet-cifar", width=8, blocks=1, **SMALL)
    linear = _linear_accuracy(task)
    cnn = _cnn_accuracy(task, steps=150, lr=3e-3)
    print(f"linear {linear:.3f} cnn {cnn:.3f}")
    assert 0.12 < linear < 0.40, linear  # above chance (the colour cast and clutter leak a little)
    assert 0.6 < cnn <= 1.0, cnn
    assert cnn > linear + 0.25, (cnn, linear)


# --- the FLOPs regime -----------------------------------------------------------------------------


class Bottleneck(nn.Module):
    """ResNet-50's block: 1x1 -> 3x3 (stride) -> 1x1 (4x wider), BatchNorm, projection shortcut."""

    def __init__(self, c_in: int, mid: int, stride: int):
        super().__init__()
        out = 4 * mid
        self.conv1, self.bn1 = nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + self.shortcut(x))


class ResNet50Cifar(nn.Module):
    """ResNet-50 with the usual CIFAR stem (3x3 conv, no max-pool), 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        blocks, c_in = [], 64
        for stage, (count, mid) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
            for i in range(count):
                blocks.append(Bottleneck(c_in, mid, 2 if stage > 0 and i == 0 else 1))
                c_in = 4 * mid
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c_in, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _flops_per_param_per_sample(flops: int, params: int, batch: int) -> float:
    return flops / batch / params


def test_resnet_cifar_default_is_in_resnet50_cifar10_regime() -> None:
    batch = 4
    x, y = torch.zeros(batch, 3, 32, 32), torch.zeros(batch, dtype=torch.int64)
    with torch.device("meta"):
        r50 = ResNet50Cifar()
    ref = profile_step(r50, cross_entropy, x, y)
    assert 23.4e6 < ref.params < 23.6e6  # 23.52M
    assert 2.5e9 < ref.flops / batch / 3 < 2.7e9  # forward: 2.59 GFLOPs (1.30 GMACs) per image
    ref_ratio = _flops_per_param_per_sample(ref.flops, ref.params, batch)
    assert 320 < ref_ratio < 340  # 331

    step = profile_task(build("resnet-cifar", **SMALL), batch)
    ratio = _flops_per_param_per_sample(step.flops, step.params, batch)
    assert ref_ratio / 2 < ratio < ref_ratio * 2, (ratio, ref_ratio)  # 298 vs 331
    convnext = profile_task(build("convnext-cifar", **SMALL), batch)
    # depthwise 7x7 convs and 1x1 bottlenecks: fewer FLOPs per parameter than ResNet, within 2x of it (183)
    assert ref_ratio / 2 < _flops_per_param_per_sample(convnext.flops, convnext.params, batch) < 0.7 * ref_ratio
    vgg = profile_task(build("vgg-cifar", **SMALL), batch)
    # VGG puts most parameters in its 2x2 and 4x4 stages: fewer FLOPs per parameter, like VGG itself
    assert 80 < _flops_per_param_per_sample(vgg.flops, vgg.params, batch) < 140


def test_spec_defaults() -> None:
    spec = ResnetCifarSpec()
    assert (spec.width, spec.blocks, spec.batch_size, spec.optimizer, spec.samples) == (16, 2, 32, "adamw", 10_000)
    assert (VggCifarSpec().depth, VggCifarSpec().width) == (11, 32)


# --- a distributed run ----------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_rank_ddp_run_finishes(cli, db_rows) -> None:
    result = cli("run", "--workload", "resnet-cifar", "--strategy", "ddp", "--world-size", "2", "--steps", "3",
                 "--set", "workload.samples=200", "--set", "workload.test_samples=40", "--quiet", timeout_s=170)
    assert result.returncode == 0, result.stderr
    assert db_rows("SELECT status FROM runs") == [("finished",)]
    assert db_rows("SELECT COUNT(*) FROM steps")[0][0] == 6


def test_convnext_learns_what_a_linear_model_cannot() -> None:
    """ConvNeXt blocks (depthwise 7x7, inverted bottleneck) at width 16: 0.54 after 150 AdamW steps
    of 32 images; logistic regression on the same data reaches about 0.27 (the resnet test above)."""
    torch.set_num_threads(2)
    task = build("convnext-cifar", width=16, **SMALL)
    blocks = task.model.blocks
    assert len(blocks) == 4 and [b[-1].depthwise.groups for b in blocks] == [16, 32, 64, 128]
    assert 0.42 < _cnn_accuracy(task, steps=150, lr=1e-3) <= 1.0
