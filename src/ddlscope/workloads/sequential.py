"""A model as layers applied in order: what `pipeline` and `partitioned` cut into stages.

ddlscope's GPT says it itself (`pipeline_layers()`); an nn.Sequential is one.
For the user's models we find the sequence, and refuse where there is none:

- torchvision and timm classifiers (ResNet, VGG, DenseNet, EfficientNet,
  ConvNeXt, MobileNet, ShuffleNet, timm's ResNets...): torch.fx traces the
  forward with every submodule kept whole; the forward is a chain when each
  step takes only the step before's output (plus constants) and nothing
  else uses that output. Then the layers are the called children, in call
  order (an nn.Sequential opened into its modules: finer places to cut),
  with the tensor ops between them (`torch.flatten(x, 1)`, `x.mean([2, 3])`,
  `F.relu`) as small modules. A branch, a parameter of the
  model itself (ViT's class token), or a forward fx cannot trace is not a
  chain; the reason says which.
- Hugging Face causal LMs (`HFModel`) of the llama family (llama, mistral,
  qwen2, qwen3) and gpt2: [embedding, decoder layers..., final norm + head].
  Positions, rotary embeddings and the causal mask are computed inside each
  decoder-layer stage from the hidden states' shape, as the model computes
  them, so only hidden states cross stages and the logits are the model's.

The layers share the model's parameters (no copies), so the model's state
dict names still name them.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import Tensor, fx, nn

from ddlscope.specs import ConfigError

# Hugging Face model types whose decoder is embed_tokens -> layers (rotary positions, a causal mask) ->
# norm, each checked against the whole model's logits in tests/test_pipeline_sources.py.
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
GPT2_LIKE = ("gpt2",)


class NotAChain(Exception):
    """The model's forward is not its layers applied in order; the message says why (one line)."""


def layer_sequence_of(model: nn.Module) -> list[nn.Module] | None:
    """The model as layers applied in order, or None where its forward is not such a chain."""
    try:
        return split_layers(model)
    except NotAChain:
        return None


def split_layers(model: nn.Module) -> list[nn.Module]:
    """The model as layers applied in order; raises NotAChain with the reason where it is not."""
    pipeline_layers = getattr(model, "pipeline_layers", None)
    if callable(pipeline_layers):
        return list(pipeline_layers())
    if isinstance(model, nn.Sequential):
        return list(model)
    if _is_hf(model):
        return hf_layers(model)
    return traced_layers(model)


def shared_parameters(layers: list[nn.Module]) -> list[tuple[nn.Parameter, int, int]]:
    """Parameters held by two layers of the sequence: (the parameter, the first layer, the other).
    Tied input and output embeddings (gpt2) are the usual case: cut apart, each stage would train its
    own copy."""
    seen: dict[int, int] = {}
    shared = []
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            if id(p) in seen and seen[id(p)] != index:
                shared.append((p, seen[id(p)], index))
            seen.setdefault(id(p), index)
    return shared


# --- torchvision / timm: a traced chain ------------------------------------------------------------------


class _WholeModules(fx.Tracer):
    """Keeps every called submodule as one node: the chain is over what the model's forward calls."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def traced_layers(model: nn.Module) -> list[nn.Module]:
    try:
        graph = _WholeModules().trace(model)
    except Exception as exc:  # noqa: BLE001 (whatever fx refuses, the reason is one line)
        raise NotAChain(f"torch.fx cannot trace its forward ({_first_line(exc)})") from None
    return _chain(model, graph)


def _chain(model: nn.Module, graph: fx.Graph) -> list[nn.Module]:
    nodes = list(graph.nodes)
    inputs = [n for n in nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        raise NotAChain(f"its forward takes {len(inputs)} inputs; a chain takes one tensor")
    layers: list[nn.Module] = []
    current = inputs[0]
    for node in nodes:
        if node.op == "placeholder":
            continue
        if len(current.users) != 1:
            raise NotAChain(f"its forward is not a chain: {_describe(current)} feeds {len(current.users)} steps "
                            f"({', '.join(_describe(n) for n in current.users)})")
        if node.all_input_nodes != [current]:
            raise NotAChain(f"its forward is not a chain: {_describe(node)} takes "
                            f"{', '.join(_describe(n) for n in node.all_input_nodes) or 'no tensor'}")
        if node.op == "output":
            if node.args[0] is not current:
                raise NotAChain("its forward returns more than the last step's tensor")
            break
        layers.extend(_unnested(_layer_of(model, node)))
        current = node
    _not_in_place(layers)
    return layers


def _unnested(layer: nn.Module) -> list[nn.Module]:
    """An nn.Sequential (torchvision's `features`, ResNet's `layer1`) as its modules, recursively: finer
    places to cut, the same computation. A subclass with its own forward stays whole."""
    if isinstance(layer, nn.Sequential) and type(layer).forward is nn.Sequential.forward:
        return [inner for child in layer for inner in _unnested(child)]
    return [layer]


def _layer_of(model: nn.Module, node: fx.Node) -> nn.Module:
    if node.op == "call_module":
        return model.get_submodule(str(node.target))
    if node.op == "get_attr":
        raise NotAChain(f"its forward uses {node.target}, a tensor of the model itself, not of a layer")
    if node.op == "call_function" and node.target is torch.flatten:
        rest = node.args[1:]
        start = rest[0] if len(rest) > 0 else node.kwargs.get("start_dim", 0)
        end = rest[1] if len(rest) > 1 else node.kwargs.get("end_dim", -1)
        return nn.Flatten(int(start), int(end))
    if node.op in ("call_function", "call_method"):
        if not node.args or not isinstance(node.args[0], fx.Node):  # the tensor as a keyword or a later argument
            raise NotAChain(f"its forward passes the tensor to {_describe(node)} other than first")
        return TensorOp(node.target, node.args[1:], dict(node.kwargs), method=node.op == "call_method")
    raise NotAChain(f"its forward has a {node.op} step ({node.target})")


class TensorOp(nn.Module):
    """A tensor operation of the model's forward between two layers (`x.mean([2, 3])`, `F.relu(x)`), as
    a layer: applied to its one tensor input with the forward's constant arguments."""

    def __init__(self, target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 method: bool):
        super().__init__()
        # In place on a stage's received input would fail (a leaf that needs its gradient); same values.
        kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
        self.target, self.args, self.kwargs, self.method = target, tuple(args), kwargs, method

    def forward(self, x: Tensor) -> Tensor:
        if self.method:
            return getattr(x, str(self.target))(*self.args, **self.kwargs)
        return self.target(x, *self.args, **self.kwargs)  # type: ignore[operator]

    def extra_repr(self) -> str:
        name = self.target if isinstance(self.target, str) else getattr(self.target, "__name__", str(self.target))
        return f"{name}, args={self.args}, kwargs={self.kwargs}"


def _not_in_place(layers: list[nn.Module]) -> None:
    """A top-level activation in place (ResNet's `relu`) may start a stage, whose input is a leaf that
    needs its gradient: autograd refuses in-place there. Out of place computes the same values."""
    for layer in layers:
        if getattr(layer, "inplace", False) is True:
            layer.inplace = False  # type: ignore[assignment]


def _describe(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "the input"
    if node.op == "output":
        return "the output"
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return f"{name!s}" if node.op == "call_module" else f"{name}()"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:160]


# --- Hugging Face causal LMs --------------------------------------------------------------------------------


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "hf") and hasattr(getattr(model, "hf"), "config") and hasattr(model, "_causal")


def hf_layers(model: nn.Module) -> list[nn.Module]:
    """[embedding, decoder layer stages..., final norm + head] of an `HFModel` causal LM."""
    hf = model.hf  # type: ignore[attr-defined]
    kind = getattr(hf.config, "model_type", type(hf).__name__)
    if not model._causal:  # type: ignore[attr-defined]
        raise NotAChain(f"hf:{kind} is an encoder (sequence classifier); pipeline splits causal LMs")
    if kind in LLAMA_LIKE:
        return _llama_layers(hf)
    if kind in GPT2_LIKE:
        return _gpt2_layers(hf)
    raise NotAChain(f"hf:{kind}: its decoder layout is not one ddlscope cuts; causal LMs that split: "
                    f"{', '.join('hf:' + k for k in (*LLAMA_LIKE, *GPT2_LIKE))}")


def _llama_layers(hf: nn.Module) -> list[nn.Module]:
    decoder = hf.model
    config = hf.config
    types = getattr(config, "layer_types", None)
    blocks = [DecoderLayer(layer, config, _sliding(config, types, i), copy.deepcopy(decoder.rotary_emb))
              for i, layer in enumerate(decoder.layers[:config.num_hidden_layers])]
    return [TokenEmbedding(decoder.embed_tokens), *blocks, Head(decoder.norm, hf.lm_head)]


def _gpt2_layers(hf: nn.Module) -> list[nn.Module]:
    body = hf.transformer
    blocks = [DecoderLayer(block, hf.config, False) for block in body.h]
    return [TokenEmbedding(body.wte, body.wpe, body.drop), *blocks, Head(body.ln_f, hf.lm_head)]


def _sliding(config: Any, types: list[str] | None, index: int) -> bool:
    """Whether layer `index` attends through a sliding window (qwen2's layer_types; mistral's
    sliding_window for all layers), as the model picks its mask."""
    if types is not None:
        return types[index] == "sliding_attention"
    return getattr(config, "sliding_window", None) is not None


class TokenEmbedding(nn.Module):
    """Token ids -> hidden states: the token table, plus a learned position table and dropout (gpt2)."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Embedding | None = None, dropout: nn.Module | None = None):
        super().__init__()
        self.tokens, self.positions, self.dropout = tokens, positions, dropout

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(_positions(h))
        return self.dropout(h) if self.dropout is not None else h


class DecoderLayer(nn.Module):
    """One decoder layer on hidden states alone: positions, rotary embeddings and the causal mask come
    from the hidden states' shape, as the whole model makes them for a batch without padding."""

    def __init__(self, layer: nn.Module, config: Any, sliding: bool, rotary: nn.Module | None = None):
        super().__init__()
        # The rotary module is each stage's own copy: buffers only, and a stage that is released to the
        # meta device must not take another stage's with it.
        self.layer, self.rotary = layer, rotary
        self._config, self._sliding = config, sliding  # not submodules

    def forward(self, h: Tensor) -> Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        positions = _positions(h)
        make_mask = create_sliding_window_causal_mask if self._sliding else create_causal_mask
        # position_ids only tell the mask about packed sequences (positions restarting), which arange
        # never has; left out, the mask is the same and needs no .item() (a meta forward can build it).
        mask = make_mask(config=self._config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=None)
        extra = {"position_embeddings": self.rotary(h, position_ids=positions)} if self.rotary is not None else {}
        out = self.layer(h, attention_mask=mask, position_ids=positions, use_cache=False, **extra)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    """Hidden states -> logits: the final norm, then the output layer."""

    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h: Tensor) -> Tensor:
        return self.head(self.norm(h))


def _positions(h: Tensor) -> Tensor:
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


# --- where to cut ---------------------------------------------------------------------------------------


def layer_flops(layers: list[nn.Module], example: Tensor) -> list[float]:
    """Forward FLOPs of each layer on `example` (a batch of the model's input). Give layers on the meta
    device (e.g. of a model built there) and a meta example: no compute, no memory."""
    from torch.utils.flop_counter import FlopCounterMode

    h, flops = example, []
    with torch.no_grad():
        for layer in layers:
            with FlopCounterMode(display=False) as counter:
                h = layer(h)
            flops.append(float(counter.get_total_flops()))
    return flops


def balanced_cuts(costs: list[float], stages: int, allowed: list[int] | None = None) -> list[int]:
    """Cut points (where stages 1.. start) that minimise the costliest stage's summed cost, exactly (a
    dynamic program over prefixes, the partitioner's rule with time alone); cuts only at indices in
    `allowed` (e.g. layers with parameters, so no stage starts with a parameterless op)."""
    n = len(costs)
    starts = sorted(set(allowed if allowed is not None else range(1, n)) & set(range(1, n)))
    if stages - 1 > len(starts):
        raise ConfigError(f"{stages} stages: the model has only {len(starts) + 1} places to start one")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ends = [0, *starts, n]  # where a stage may end (exclusive); index 0 is the empty prefix
    inf = float("inf")
    # best[k][j]: the smallest costliest stage placing layers[:ends[j]] on k stages; back: the previous end
    best = [[inf] * len(ends) for _ in range(stages + 1)]
    back = [[0] * len(ends) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(1, len(ends)):
            for i in range(j):
                value = max(best[k - 1][i], prefix[ends[j]] - prefix[ends[i]])
                if value < best[k][j]:
                    best[k][j], back[k][j] = value, i
    cuts, j = [], len(ends) - 1
    for k in range(stages, 1, -1):
        j = back[k][j]
        cuts.append(ends[j])
    return sorted(cuts)


def with_parameters(layers: list[nn.Module]) -> list[int]:
    """Indices of the layers that hold parameters."""
    return [i for i, layer in enumerate(layers) if any(True for _ in layer.parameters())]

