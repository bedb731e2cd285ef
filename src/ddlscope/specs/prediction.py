"""What `predict` and `plan` take: one model, one parallel layout, one cluster (torch-free).

The CLI merges a TOML file's tables with its flags into one dict and validates it here once;
bad input becomes one `ConfigError` line that names the flag when a flag gave the value and the
config key when the file did. What needs the cluster's GPU count (dp's default) or a built model
(a source's layers, a decoder's shapes) is checked where those are known: `ParallelInput.layout`,
and the predictor (ddlscope.predict), which validates its own dataclasses as well.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from ddlscope.specs.base import ConfigError, Spec, describe_validation_error

Attention = Literal["flash", "unfused"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["1f1b", "gpipe"]
Dtype = Literal["bf16", "fp16", "fp32"]
Optimizer = Literal["sgd", "sgd-momentum", "adamw"]
CNN_MODELS = ("resnet50", "vgg16", "densenet121")  # hand-written layer lists (predict/cnn.py)
MODELS = ("gpt", *CNN_MODELS)
CNN_ONLY_KEYS = ("image_size", "classes", "optimizer")
GPT_ONLY_KEYS = ("hidden", "heads", "layers", "seq", "vocab", "attention", "ffn_hidden", "kv_heads", "gated_mlp",
                 "experts", "top_k", "capacity_factor", "expert_imbalance")
REQUIRED_GPT_KEYS = ("hidden", "heads", "layers", "seq", "vocab", "global_batch")
# A transformers decoder's MLP and embeddings are read off the model built from these sizes, so knobs that
# would say otherwise are refused rather than silently overridden.
HF_READ_KEYS = ("gated_mlp", "experts", "top_k", "capacity_factor", "expert_imbalance", *CNN_ONLY_KEYS)
# [parallel] keys that describe the software stack rather than the layout: plan keeps them for every layout
STACK_KEYS = ("overlap_grad_reduce", "fused_grad_accumulation")
SOURCE_IMAGE_SIZES = (8, 1024)  # a traced torchvision/timm/module model: smaller images vanish in its pools

Size = Annotated[int, Field(ge=1)]


def _no_bool(value: Any) -> Any:
    # A Literal of ints takes True as 1 even in strict mode; `zero = true` is a typo, not stage 1.
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


class _Input(Spec):
    # strict: TOML and typer hand over typed values; "4" or 4.0 for a size is a mistake to name, not to coerce
    model_config = ConfigDict(strict=True)


class ModelInput(_Input):
    """[model]: a GPT by its sizes, a hand-written CNN, a registered vision workload, a transformers
    decoder `hf:ARCH` (its sizes from here, the rest read off it), or a traced image model
    `torchvision:NAME`, `timm:NAME`, `module:PKG.MOD:FACTORY`."""

    name: str = "gpt"
    _preset: str | None = PrivateAttr(None)  # the well-known model the sizes came from (predict/models.toml)
    hidden: Size | None = None
    heads: Size | None = None
    layers: Size | None = None
    seq: Size | None = None
    vocab: Size | None = None
    global_batch: Size | None = None
    attention: Attention = "flash"
    dtype: Dtype | None = None  # a GPT's default is bf16, a CNN's fp32 (TF32 tensor cores)
    ffn_hidden: int = Field(0, ge=0, description="MLP width; 0: 4 x hidden")
    kv_heads: int = Field(0, ge=0, description="0: = heads; fewer: grouped-query attention")
    gated_mlp: bool = False
    image_size: Size | None = None
    classes: Size | None = None
    optimizer: Optimizer | None = None
    experts: int = Field(0, ge=0, description="mixture of experts: experts per layer; 0: a dense MLP")
    top_k: Size = 2
    capacity_factor: float = 0.0
    expert_imbalance: float = 1.0

    @field_validator("name")
    @classmethod
    def _known(cls, name: str, info: ValidationInfo) -> str:
        if ":" in name or name in MODELS:  # a model source is checked by its workload when it is built
            return name
        # Registered vision workloads import torch to list; the CLI passes them as a callable, asked only here.
        workloads = tuple((info.context or {}).get("vision_workloads", tuple)())
        if name not in workloads:
            presets = tuple((info.context or {}).get("presets", ()))
            rest = f", a preset: {', '.join(presets)}" if presets else ""
            rest += f", or a vision workload: {', '.join(workloads)}" if workloads else ""
            raise _bad(f"allowed: {', '.join(MODELS)}{rest}")
        return name

    @property
    def preset(self) -> str | None:
        return self._preset

    def from_preset(self, name: str | None) -> "ModelInput":
        """This model, noted as the preset `name` whose sizes it holds (None: given by its sizes)."""
        self._preset = name
        return self

    @property
    def kind(self) -> Literal["gpt", "hf", "cnn", "source", "workload"]:
        """How the step is modelled: a GPT, a decoder read off transformers, or one of three kinds of CNN."""
        if ":" in self.name:
            return "hf" if self.name.partition(":")[0] == "hf" else "source"
        return "gpt" if self.name == "gpt" else "cnn" if self.name in CNN_MODELS else "workload"

    @property
    def is_cnn(self) -> bool:
        return self.kind in ("cnn", "source", "workload")

    @model_validator(mode="after")
    def _knobs_fit_the_model(self) -> "ModelInput":
        if self.kind == "hf":
            self._refuse_read_keys()
        elif self.kind == "gpt":
            self._refuse_keys(CNN_ONLY_KEYS, f" is for a CNN model ({', '.join(CNN_MODELS)})")
        else:
            self._check_cnn()
        missing = [key for key in (REQUIRED_GPT_KEYS if not self.is_cnn else ("global_batch",))
                   if getattr(self, key) is None]
        if missing:
            raise PydanticCustomError("missing", "Field required", {"field": missing[0], "fields": ",".join(missing)})
        return self

    def _refuse_keys(self, keys: Sequence[str], why: str) -> None:
        """Refuse the first of `keys` given: `--key (model.key)` and `why`, which says what the model takes."""
        for key in keys:
            if key in self.model_fields_set:
                raise _refused(f"--{key.replace('_', '-')} (model.{key}){why}")

    def _refuse_read_keys(self) -> None:
        self._refuse_keys(HF_READ_KEYS, f": {self.name} is read off the model; give its sizes (--hidden, --heads, "
                                        "--layers, --kv-heads, --ffn-hidden, --seq, --vocab)")

    def _check_cnn(self) -> None:
        self._refuse_keys(GPT_ONLY_KEYS, f" is a GPT option; {self.name} takes --global-batch, --image-size, "
                                         "--classes, --dtype")
        for key in ("image_size", "classes"):
            if self.kind == "workload" and key in self.model_fields_set:
                raise _bad(f"{self.name} is a registered workload; its images (32x32, 10 classes) are fixed",
                           field=key)
        low, high = SOURCE_IMAGE_SIZES
        if self.kind == "source" and self.image_size is not None and not low <= self.image_size <= high:
            raise _bad(f"must be between {low} and {high}", field="image_size", value=self.image_size)

    def gpt_knobs(self) -> dict[str, Any]:
        """predict.ModelSpec's fields for a GPT (its defaults where none was given)."""
        return self.model_dump(include={"name", *REQUIRED_GPT_KEYS, *GPT_ONLY_KEYS, "dtype"}, exclude_none=True)

    def decoder_knobs(self) -> dict[str, Any]:
        """The sizes a transformers decoder is built from (workloads.sources.HFSpec's fields)."""
        knobs = {"name": self.name, "hidden": self.hidden, "heads": self.heads, "layers": self.layers,
                 "seq_len": self.seq, "vocab": self.vocab}
        if self.kv_heads:  # 0 is "the architecture's default", not a size
            knobs["kv_heads"] = self.kv_heads
        if self.ffn_hidden:
            knobs["intermediate"] = self.ffn_hidden
        return knobs

    def batch_knobs(self) -> dict[str, Any]:
        """What a decoder's step model takes besides its shapes: the batch and the kernels' precision."""
        return self.model_dump(include={"global_batch", "attention", "dtype"}, exclude_none=True)

    def cnn_knobs(self) -> dict[str, Any]:
        """predict.cnn.CNNSpec's fields, but the layers (which the CLI records from the model)."""
        knobs = self.model_dump(include={"name", "global_batch", "image_size", "classes", "dtype", "optimizer"},
                                exclude_none=True)
        if self.kind == "source":
            knobs = {"image_size": 224, "classes": 1000, **knobs}
        elif self.kind == "workload":
            knobs.update(image_size=32, classes=10)
        return knobs


class ParallelInput(_Input):
    """[parallel]: how one step is spread over the GPUs (plan searches the layout and keeps STACK_KEYS)."""

    tp: Size = 1
    cp: Size = 1
    pp: Size = 1
    dp: Size | None = None  # default: GPUs / (tp x cp x pp)
    ep: Size = 1
    micro_batch: Size = 1
    zero: Annotated[Literal[0, 1, 2, 3], BeforeValidator(_no_bool)] = 0
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    interleave: Size = 1
    schedule: Schedule = "1f1b"
    overlap_grad_reduce: bool = True
    fused_grad_accumulation: bool = False
    bucket_mb: float = Field(25.0, gt=0)
    strategy: str | None = None  # a CNN's: checked against the CNN strategies by predict.cnn_predict

    def layout(self, n_gpus: int) -> dict[str, Any]:
        """predict.ParallelSpec's fields on a cluster of `n_gpus`, dp defaulting to every GPU the others leave."""
        knobs = self.model_dump(exclude={"strategy"})
        if self.dp is None:
            tp, pp, cp = self.tp, self.pp, self.cp
            if n_gpus % (tp * pp * cp):
                sizes = f"tp x pp = {tp} x {pp}" if cp == 1 else f"tp x cp x pp = {tp} x {cp} x {pp}"
                raise ConfigError(f"{sizes} = {tp * pp * cp}: must divide the cluster's {n_gpus} GPUs")
            knobs["dp"] = n_gpus // (tp * pp * cp)
        return knobs

    def stack(self) -> dict[str, bool]:
        """The gradient handling given (the predictor's defaults stand for the rest)."""
        return self.model_dump(include=set(STACK_KEYS) & self.model_fields_set)


class PredictionInput(_Input):
    """Everything `predict` and `plan` read from a config file and flags (flags win)."""

    cluster: str = Field(description="NAME:NODESxGPUS_PER_NODE, e.g. a100-80gb:64x8")
    spot: bool = False
    # NaN passes here: the catalogue's refusal names the device's bound (predict.catalogue)
    sustained_fraction: float | None = Field(None, allow_inf_nan=True)
    # a named software stack (predict/catalogue.toml [stacks]); None: `ideal`. The catalogue checks the name
    stack: str | None = None
    model: ModelInput = Field(default_factory=dict, validate_default=True)  # type: ignore[arg-type]
    parallel: ParallelInput = Field(default_factory=dict, validate_default=True)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _strategy_is_a_cnns(self) -> "PredictionInput":
        if self.parallel.strategy is not None and not self.model.is_cnn:
            raise _refused(f"--strategy is for a CNN model ({', '.join(CNN_MODELS)}); a GPT's data-parallel "
                           "strategy is --zero")
        return self


class PlanSearch(_Input):
    """`plan`'s search: what it ranks by, how many it shows, the largest micro-batch it tries."""

    by: Literal["time", "cost"] = "time"
    top: Size = 5
    max_micro_batch: Size = 64


def read_input(spec_class: type[_Input], data: dict[str, Any], flags: Collection[str] = (),
               vision_workloads: Callable[[], Sequence[str]] | None = None, presets: Sequence[str] = ()) -> Any:
    """`data` as `spec_class`, or a ConfigError of one line. `flags`: the dotted keys a flag gave
    ("model.hidden"), named as flags in a message; `vision_workloads` and `presets` (well-known models,
    which the caller has expanded into their sizes): what else a model name may be, listed only when a
    name is none of the built-in ones."""
    context = {"vision_workloads": vision_workloads, "presets": presets} if vision_workloads or presets else None
    try:
        return spec_class.model_validate(data, context=context)
    except ValidationError as err:
        raise ConfigError(describe_input_error(err, spec_class, flags)) from None


# ---------------------------------------------------------------------------- messages
_NO_VALUE = object()
_RULES = {"int_type": "must be an integer", "bool_type": "must be true or false", "float_type": "must be a number",
          "finite_number": "must be a finite number", "string_type": "must be a string"}


def _refused(message: str) -> PydanticCustomError:
    """A refusal that is its own whole line."""
    return PydanticCustomError("refused", "{message}", {"message": message})


def _bad(rule: str, field: str | None = None, value: Any = _NO_VALUE) -> PydanticCustomError:
    """A refusal of one field's value: `field` and `value` where a model validator, not the field's, refuses."""
    ctx = {"rule": rule} | ({"field": field} if field else {}) | ({"value": value} if value is not _NO_VALUE else {})
    return PydanticCustomError("bad_value", "{rule}", ctx)


def describe_input_error(err: ValidationError, spec_class: type[BaseModel], flags: Collection[str] = ()) -> str:
    """pydantic's first error as the one line the CLI prints: `--hidden = -5: must be >= 1` when a flag
    gave it, `model.hidden = -5: must be >= 1` when the config file did."""
    errors = err.errors(include_url=False)
    # A misspelt key also leaves its field missing: naming the misspelling says what to fix.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    kind, ctx = first["type"], first.get("ctx") or {}
    loc = tuple(str(p) for p in first["loc"]) + ((ctx["field"],) if "field" in ctx else ())
    key, value = ".".join(loc), ctx.get("value", first.get("input"))
    label = _flag(key) if key in flags else key
    if kind == "refused":
        return ctx["message"]
    if kind == "missing":  # every missing key at once: a user should not learn them one run at a time
        keys = [key for e in errors if e["type"] == "missing" for key in _missing_keys(e)]
        return f"missing {', '.join(_flag(k) for k in keys)} (or {', '.join(keys)} in the config file)"
    if kind == "extra_forbidden":
        allowed = _model_at(spec_class, loc[:-1])
        return f"{key} = {value!r}: unknown field; allowed: {', '.join(allowed.model_fields) if allowed else '-'}"
    if kind in ("model_type", "dict_type"):
        return f"{key} = {value!r}: must be a table ([{key}])"
    if kind == "bad_value":  # a model validator's refusal that gives no value: the field's name says enough
        about = label if "field" in ctx and "value" not in ctx else f"{label} = {value!r}"
        return f"{about}: {ctx['rule']}"
    if kind == "literal_error":
        return f"{label} = {value!r}: allowed: {', '.join(str(c) for c in _choices(spec_class, loc))}"
    if kind in ("greater_than_equal", "greater_than"):
        return f"{label} = {value!r}: must be {'>=' if 'ge' in ctx else '>'} {ctx.get('ge', ctx.get('gt'))}"
    if kind in _RULES:
        return f"{label} = {value!r}: {_RULES[kind]}"
    return describe_validation_error(err)


def _missing_keys(error: Any) -> list[str]:
    """The dotted keys one `missing` error names (a model validator names several in its context)."""
    loc = tuple(str(p) for p in error["loc"])
    ctx = error.get("ctx") or {}
    return [".".join((*loc, name)) for name in ctx["fields"].split(",")] if "fields" in ctx else [".".join(loc)]


def _flag(key: str) -> str:
    name = key.rpartition(".")[2]
    return "--model" if key == "model.name" else f"--{name.replace('_', '-')}"


def _model_at(spec_class: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The spec class of the table at `loc` (() is `spec_class` itself)."""
    model: Any = spec_class
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        model = field.annotation if field else None
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _choices(spec_class: type[BaseModel], loc: tuple[str, ...]) -> list[Any]:
    """The values a Literal field allows, from its annotation (pydantic's message quotes and joins them)."""
    parent = _model_at(spec_class, loc[:-1])
    field = parent.model_fields.get(loc[-1]) if parent else None
    return _literal_args(field.annotation) if field else []


def _literal_args(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [c for arg in get_args(annotation) for c in _literal_args(arg)]
