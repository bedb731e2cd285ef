"""The input of `predict` and `plan` (specs/prediction.py): one spec for file and flags, its one-line
refusals naming the flag or the config key that gave the value, and what it hands the predictor."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_args

import pytest

from ddlscope.cli import main
from ddlscope.predict import ModelSpec, ParallelSpec
from ddlscope.predict.specs import RECOMPUTE_CODES, SCHEDULE_CODES, decoder_model_spec
from ddlscope.specs import ConfigError
from ddlscope.specs.prediction import PlanSearch, PredictionInput, Recompute, Schedule, read_input

GPT = {"hidden": 1024, "heads": 16, "layers": 4, "seq": 512, "vocab": 32000, "global_batch": 64}
WORKLOADS = ("resnet-cifar", "vgg-cifar")


def refusal(data: dict[str, Any], flags: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as err:
        read_input(PredictionInput, {"cluster": "h100:1x8", **data}, flags, vision_workloads=lambda: WORKLOADS)
    return str(err.value)


def valid(data: dict[str, Any]) -> PredictionInput:
    return read_input(PredictionInput, {"cluster": "h100:1x8", **data}, vision_workloads=lambda: WORKLOADS)


@pytest.mark.parametrize(("data", "flags", "message"), [
    # the same value is named by the flag that gave it, or by its key in the config file
    ({"model": {**GPT, "hidden": -5}}, ("model.hidden",), "--hidden = -5: must be >= 1"),
    ({"model": {**GPT, "hidden": -5}}, (), "model.hidden = -5: must be >= 1"),
    ({"model": {**GPT, "hidden": 4.0}}, (), "model.hidden = 4.0: must be an integer"),
    ({"model": {**GPT, "hidden": "4096"}}, (), "model.hidden = '4096': must be an integer"),
    ({"model": {**GPT, "dtype": "fp8"}}, ("model.dtype",), "--dtype = 'fp8': allowed: bf16, fp16, fp32"),
    ({"model": {**GPT, "attention": "sparse"}}, (), "model.attention = 'sparse': allowed: flash, unfused"),
    ({"model": {**GPT, "gated_mlp": 1}}, (), "model.gated_mlp = 1: must be true or false"),
    ({"model": {**GPT, "capacity_factor": float("nan")}}, (), "model.capacity_factor = nan: must be a finite number"),
    ({"model": {**GPT, "capacity_factor": True}}, (), "model.capacity_factor = True: must be a number"),
    ({"model": {**GPT, "name": 3}}, (), "model.name = 3: must be a string"),
    ({"model": {"name": "nope", "global_batch": 8}}, ("model.name",),
     "--model = 'nope': allowed: gpt, resnet50, vgg16, densenet121, or a vision workload: resnet-cifar, vgg-cifar"),
    ({"model": GPT, "parallel": {"zero": 4}}, ("parallel.zero",), "--zero = 4: allowed: 0, 1, 2, 3"),
    ({"model": GPT, "parallel": {"zero": True}}, (), "parallel.zero = True: must be an integer"),
    ({"model": GPT, "parallel": {"micro_batch": 0}}, ("parallel.micro_batch",), "--micro-batch = 0: must be >= 1"),
    ({"model": GPT, "parallel": {"recompute": "some"}}, (), "parallel.recompute = 'some': allowed: none, selective, full"),
    ({"model": GPT, "parallel": {"bucket_mb": 0}}, (), "parallel.bucket_mb = 0: must be > 0.0"),
    ({"model": GPT, "parallel": {"fused_grad_accumulation": 3}}, (),
     "parallel.fused_grad_accumulation = 3: must be true or false"),
    ({"model": GPT, "spot": "yes"}, (), "spot = 'yes': must be true or false"),
    # what is missing is named as a flag and as the file's key
    ({}, (), "missing --hidden, --heads, --layers, --seq, --vocab, --global-batch (or model.hidden, model.heads, "
             "model.layers, model.seq, model.vocab, model.global_batch in the config file)"),
    ({"model": {k: v for k, v in GPT.items() if k != "vocab"}}, (), "missing --vocab (or model.vocab in the config file)"),
    ({"model": {"name": "resnet50"}}, (), "missing --global-batch (or model.global_batch in the config file)"),
    # a misspelt key is named before the field it leaves missing
    ({"model": {**GPT, "hiden": 3}}, (), "model.hiden = 3: unknown field; allowed: name, hidden, heads, layers, seq, "
     "vocab, global_batch, attention, dtype, ffn_hidden, kv_heads, gated_mlp, image_size, classes, optimizer, "
     "experts, top_k, capacity_factor, expert_imbalance"),
    ({"modle": GPT}, (), "modle = " + repr(GPT) + ": unknown field; allowed: cluster, spot, sustained_fraction, "
     "stack, model, parallel"),
    ({"model": "gpt"}, (), "model = 'gpt': must be a table ([model])"),
    # knobs of another kind of model
    ({"model": {**GPT, "image_size": 32}}, (), "--image-size (model.image_size) is for a CNN model (resnet50, vgg16, "
     "densenet121)"),
    ({"model": {"name": "resnet50", "global_batch": 8, "kv_heads": 2}}, (), "--kv-heads (model.kv_heads) is a GPT "
     "option; resnet50 takes --global-batch, --image-size, --classes, --dtype"),
    ({"model": {**GPT, "name": "hf:llama", "experts": 8}}, (), "--experts (model.experts): hf:llama is read off the "
     "model; give its sizes (--hidden, --heads, --layers, --kv-heads, --ffn-hidden, --seq, --vocab)"),
    ({"model": {"name": "vgg-cifar", "global_batch": 8, "classes": 100}}, (),
     "model.classes: vgg-cifar is a registered workload; its images (32x32, 10 classes) are fixed"),
    ({"model": {"name": "timm:resnet18", "global_batch": 8, "image_size": 2000}}, ("model.image_size",),
     "--image-size = 2000: must be between 8 and 1024"),
    ({"model": GPT, "parallel": {"strategy": "ddp"}}, (), "--strategy is for a CNN model (resnet50, vgg16, "
     "densenet121); a GPT's data-parallel strategy is --zero"),
])
def test_bad_input_is_one_line_naming_where_it_came_from(data, flags, message) -> None:
    assert refusal(data, flags) == message


def test_everything_missing_is_named_in_one_line_the_cluster_first() -> None:
    with pytest.raises(ConfigError, match=r"^missing --cluster, --hidden, --heads, --layers, --seq, --vocab, "
                                          r"--global-batch \(or cluster, model.hidden, .* in the config file\)$"):
        read_input(PredictionInput, {})
    with pytest.raises(ConfigError, match=r"^missing --cluster \(or cluster in the config file\)$"):
        read_input(PredictionInput, {"model": GPT})


def test_a_gpt_becomes_the_predictors_model_with_its_defaults() -> None:
    spec = valid({"model": {**GPT, "kv_heads": 4}})
    model = ModelSpec(**spec.model.gpt_knobs())
    assert model == ModelSpec(**GPT, kv_heads=4)  # dtype bf16, flash attention, a dense plain MLP
    assert spec.model.kind == "gpt" and not spec.model.is_cnn


def test_dp_defaults_to_the_gpus_the_other_sizes_leave() -> None:
    parallel = valid({"model": GPT, "parallel": {"tp": 2, "pp": 2}}).parallel
    assert ParallelSpec(**parallel.layout(16)) == ParallelSpec(tp=2, pp=2, dp=4)
    assert valid({"model": GPT, "parallel": {"tp": 2, "cp": 2}}).parallel.layout(16)["dp"] == 4
    given = valid({"model": GPT, "parallel": {"tp": 2, "dp": 3}}).parallel
    assert given.layout(16)["dp"] == 3  # given: the predictor checks it against the cluster
    with pytest.raises(ConfigError, match=r"^tp x cp x pp = 2 x 3 x 1 = 6: must divide the cluster's 16 GPUs$"):
        valid({"model": GPT, "parallel": {"tp": 2, "cp": 3}}).parallel.layout(16)


def test_plan_keeps_only_the_stack_keys_given() -> None:
    assert valid({"model": GPT}).parallel.stack() == {}
    stack = valid({"model": GPT, "parallel": {"tp": 8, "overlap_grad_reduce": False}}).parallel.stack()
    assert stack == {"overlap_grad_reduce": False}


@pytest.mark.parametrize(("model", "kind", "knobs"), [
    ({"name": "resnet50", "global_batch": 8}, "cnn", {"name": "resnet50", "global_batch": 8}),
    ({"name": "timm:resnet18", "global_batch": 8, "dtype": "bf16"}, "source",
     {"name": "timm:resnet18", "global_batch": 8, "image_size": 224, "classes": 1000, "dtype": "bf16"}),
    ({"name": "torchvision:vgg11", "global_batch": 8, "image_size": 64}, "source",
     {"name": "torchvision:vgg11", "global_batch": 8, "image_size": 64, "classes": 1000}),
    ({"name": "resnet-cifar", "global_batch": 8, "optimizer": "adamw"}, "workload",
     {"name": "resnet-cifar", "global_batch": 8, "image_size": 32, "classes": 10, "optimizer": "adamw"}),
])
def test_a_cnn_hands_over_what_it_was_given_and_its_kinds_image(model, kind, knobs) -> None:
    spec = valid({"model": model}).model
    assert spec.kind == kind and spec.is_cnn and spec.cnn_knobs() == knobs


def test_a_decoder_is_built_from_its_sizes_and_priced_with_its_batch() -> None:
    spec = valid({"model": {**GPT, "name": "hf:llama", "kv_heads": 4, "dtype": "fp16"}}).model
    assert spec.kind == "hf" and not spec.is_cnn
    assert spec.decoder_knobs() == {"name": "hf:llama", "hidden": 1024, "heads": 16, "layers": 4, "seq_len": 512,
                                    "vocab": 32000, "kv_heads": 4}  # ffn_hidden 0: the architecture's default
    assert spec.batch_knobs() == {"global_batch": 64, "attention": "flash", "dtype": "fp16"}


@pytest.mark.parametrize("gated", [False, True])
def test_a_decoders_mlp_is_the_one_whose_layer_has_the_counted_parameters(gated: bool) -> None:
    shape = {"hidden": 1024, "heads": 16, "layers": 4, "seq": 512, "vocab": 32000, "kv_heads": 4, "ffn_hidden": 2816,
             "tied_embeddings": False, "learned_positions": False}
    counted = ModelSpec(**shape, global_batch=1, gated_mlp=gated).layer_params + 3  # norms' widths aside
    model = decoder_model_spec({**shape, "layer_params": counted}, global_batch=8, name="hf:x")
    assert model.gated_mlp is gated and model.global_batch == 8 and model.name == "hf:x"
    assert not decoder_model_spec({**shape, "layer_params": None}, global_batch=8).gated_mlp


def test_the_predictor_codes_every_value_the_input_allows() -> None:
    assert list(RECOMPUTE_CODES) == list(get_args(Recompute)) and list(SCHEDULE_CODES) == list(get_args(Schedule))


def test_plan_search_names_its_flags() -> None:
    flags = ("by", "top", "max_micro_batch")
    with pytest.raises(ConfigError, match=r"^--by = 'speed': allowed: time, cost$"):
        read_input(PlanSearch, {"by": "speed"}, flags)
    with pytest.raises(ConfigError, match=r"^--max-micro-batch = 0: must be >= 1$"):
        read_input(PlanSearch, {"max_micro_batch": 0}, flags)


def test_the_cli_names_a_files_key_and_a_flag_each_as_given(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    Path("gpt.toml").write_text('cluster = "h100:1x8"\n[model]\nhidden = -5\nheads = 16\nlayers = 4\nseq = 512\n'
                                "vocab = 32000\nglobal_batch = 64\n")
    assert main(["predict", "gpt.toml"]) == 2
    assert capsys.readouterr().err.strip() == "error: model.hidden = -5: must be >= 1"
    assert main(["predict", "gpt.toml", "--hidden", "0"]) == 2  # the flag wins, and is named
    assert capsys.readouterr().err.strip() == "error: --hidden = 0: must be >= 1"
    assert main(["predict", "gpt.toml", "--hidden", "1024", "--json"]) == 0
