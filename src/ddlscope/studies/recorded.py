"""A workload's image model as the CNN layer model prices it (predict/cnn.py), recorded from one real
forward (runtime/profiler.py), with how much of torch's own FLOP count of that forward the layers hold.

Shared by `ddlscope predict/plan --model torchvision:NAME` (cli/predict.py) and `study paper --models`
(studies/paper.py): both refuse to price a model whose layers are off torch's count by more than
PRICED_FLOPS_TOLERANCE (attention, or ops the recorder does not know), and say the share otherwise.
"""

from __future__ import annotations

from typing import Any

from ddlscope.predict.cnn import Layer

# Beyond this relative difference between the layers' forward FLOPs and torch's count the layer model
# prices another network (an op it does not know); within it, the share is said (a ViT-Tiny's attention
# at 224 tokens: 0.86).
PRICED_FLOPS_TOLERANCE = 0.2


def recorded_layers(spec: Any) -> tuple[tuple[Layer, ...], float]:
    """(the layers of the spec's model for one image, their forward FLOPs over torch's count)."""
    import torch

    from ddlscope.runtime.profiler import cnn_layer_records, forward_flops
    from ddlscope.workloads.sources import example_input, model_of

    torch.manual_seed(0)
    model = model_of(spec)
    image = example_input(spec, 1)
    layers = tuple(Layer(**record) for record in cnn_layer_records(model, image))
    priced = 2 * sum(layer.macs for layer in layers) / max(forward_flops(model, image), 1.0)
    return layers, priced


def priced_well(priced: float) -> bool:
    return abs(priced - 1) <= PRICED_FLOPS_TOLERANCE
