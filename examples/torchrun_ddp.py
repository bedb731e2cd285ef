"""A plain DDP training loop, as a user could have written it, with ddlscope attached (3 lines).

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --steps 20      # plain torchrun
    ddlscope launch --nproc 2 examples/torchrun_ddp.py -- --steps 20     # under ddlscope's launcher
    python examples/torchrun_ddp.py --fsdp                               # FSDP2 instead of DDP

Then `ddlscope runs`, `ddlscope show RUN`, `ddlscope report RUN`. The data is generated (a noisy
linear rule the network can learn), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import ddlscope


def make_model(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def batches(rank: int, batch: int, steps: int):
    generator = torch.Generator().manual_seed(1234 + rank)
    rule = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        x = torch.randn(batch, 32, generator=generator)
        yield x, (x @ rule + 0.1 * torch.randn(batch, 4, generator=generator)).argmax(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    parser.add_argument("--run", default=None, help="the run's name in ddlscope's store")
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model = make_model(args.width)
    if distributed and args.fsdp:
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    elif distributed:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    meter = ddlscope.attach(model, optimizer, run=args.run)            # ddlscope: 1
    for x, y in batches(rank, args.batch, args.steps):
        with meter.step(samples=len(x)) as step:                        # ddlscope: 2
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step.loss = loss                                            # ddlscope: 3
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
