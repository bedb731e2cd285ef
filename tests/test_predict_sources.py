"""`predict` and `plan` on any model: torchvision/timm image models traced into the CNN layer model,
transformers decoders (`hf:ARCH`) as the step model's GPT with their true embeddings and MLP."""

from __future__ import annotations

import json

import pytest

from ddlscope.cli import main
from ddlscope.predict import ModelSpec, ParallelSpec, parse_cluster, predict

LLAMA_70B = ["--hidden", "8192", "--layers", "80", "--heads", "64", "--kv-heads", "8", "--ffn-hidden", "28672",
             "--vocab", "128256", "--seq", "8192"]
LLAMA_8B = ["--hidden", "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--ffn-hidden", "14336",
            "--vocab", "128256", "--seq", "8192"]


def predicted(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["predict", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_traced_torchvision_resnet50_is_the_hand_written_one(strategy: str, capsys) -> None:
    args = ["--cluster", "a100-80gb:2x8", "--global-batch", "512", "--strategy", strategy]
    traced = predicted(capsys, "--model", "torchvision:resnet50", *args)
    written = predicted(capsys, "--model", "resnet50", *args)
    assert traced["parameters"] == written["parameters"] == 25_557_032  # torchvision's published count
    assert traced["forward_gmacs_per_sample"] == pytest.approx(4.089, abs=0.001)  # published "4.09 GFLOPS"
    assert traced["fsdp_units"] == written["fsdp_units"] == 18  # 16 bottlenecks + stem + classifier
    assert traced["step_time_s"] == pytest.approx(written["step_time_s"], rel=1e-9)
    # the traced list keeps one more saved tensor than the hand-written one: within 10%
    assert 1.0 <= traced["activation_mb_per_sample"] / written["activation_mb_per_sample"] < 1.1


def test_per_position_linears_are_priced_at_every_position(capsys) -> None:
    # ConvNeXt's MLP is nn.Linear over channels-last pixels: 4.46 GMACs at 224 (torchvision's table)
    out = predicted(capsys, "--model", "torchvision:convnext_tiny", "--cluster", "a100-80gb:1x8", "--global-batch", "64")
    assert out["forward_gmacs_per_sample"] == pytest.approx(4.46, rel=0.01)
    assert not out["notes"]


def test_what_the_layer_model_does_not_price_is_said(capsys) -> None:
    out = predicted(capsys, "--model", "timm:vit_tiny_patch16_224", "--cluster", "a100-80gb:1x8",
                    "--global-batch", "64")
    (note,) = out["notes"]
    share = float(note.split("prices ")[1].split("%")[0])
    assert 80 < share < 95  # attention: about 14% of a ViT-Tiny's forward at 197 tokens, width 192


@pytest.mark.parametrize(("argv", "params"), [(LLAMA_70B, 70_553_706_496), (LLAMA_8B, 8_030_261_248)])
def test_llama_configs_are_priced_with_their_own_parameters(argv: list[str], params: int, capsys) -> None:
    out = predicted(capsys, "--model", "hf:llama", *argv, "--global-batch", "512", "--cluster", "h100:16x8",
                    "--tp", "8", "--pp", "2", "--dp", "8", "--micro-batch", "1", "--recompute", "selective")
    model = out["model"]
    assert model["gated_mlp"] and not model["tied_embeddings"] and not model["learned_positions"]
    assert model["kv_heads"] == 8
    assert out["parameters"] == pytest.approx(params, rel=5e-4)  # biases and norm widths aside: exact shapes
    assert out["step_time_s"] > 0 and out["memory_gb_per_gpu"] > 0


def test_gpt2_keeps_its_tied_embedding_and_learned_positions(capsys) -> None:
    out = predicted(capsys, "--model", "hf:gpt2", "--hidden", "768", "--layers", "12", "--heads", "12", "--vocab",
                    "50257", "--seq", "1024", "--global-batch", "8", "--cluster", "a100-80gb:1x1")
    model = out["model"]
    assert model["tied_embeddings"] and model["learned_positions"] and not model["gated_mlp"]
    assert out["parameters"] == pytest.approx(124_439_808, rel=2e-4)  # GPT-2 small


def test_an_untied_output_layer_is_held_as_its_own_weights() -> None:
    cluster = parse_cluster("h100:1x8")
    parallel = ParallelSpec(tp=1, pp=1, dp=8, micro_batch=1, zero=0)
    shape = dict(hidden=1024, heads=16, layers=4, seq=512, vocab=32000, global_batch=64)
    tied, untied = (ModelSpec(**shape, tied_embeddings=t) for t in (True, False))
    assert untied.params - tied.params == 32000 * 1024
    per_param = [predict(m, parallel, cluster).memory_breakdown_gb["parameters"] * 1e9 / m.params
                 for m in (tied, untied)]
    assert per_param[0] == pytest.approx(per_param[1], rel=1e-9)  # the memory holds what params counts


def test_plan_ranks_a_source_model(capsys) -> None:
    assert main(["plan", "--model", "hf:llama", *LLAMA_8B, "--global-batch", "512", "--cluster", "h100:8x8",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["top"]
    assert rows and all(row["fits"] for row in rows)


def test_advise_prices_an_image_model_as_predict_does(capsys, tmp_path) -> None:
    args = ["--cluster", "a100-80gb:2x8", "--global-batch", "256", "--micro-batch", "16", "--image-size", "64",
            "--classes", "10", "--strategy", "ddp"]
    predicted_compute = predicted(capsys, "--model", "torchvision:resnet18", *args)["breakdown_s"]["compute"]
    assert main(["advise", "--workload", "torchvision:resnet18", "--set", "workload.image_size=64", "--batch-size",
                 "256", "--cluster", "a100-80gb:2x8", "--db", str(tmp_path / "none.db"), "--json"]) == 0
    advised = {s["strategy"]: s for s in json.loads(capsys.readouterr().out)["strategies"]}
    assert advised["ddp"]["compute_s"] == pytest.approx(predicted_compute, rel=1e-3)


def test_predict_json_carries_the_memory_commands_figures(capsys) -> None:
    out = predicted(capsys, "--model", "torchvision:resnet18", "--image-size", "64", "--classes", "10",
                    "--cluster", "a100-80gb:1x2", "--global-batch", "8", "--strategy", "fsdp")
    assert main(["memory", "torchvision:resnet18", "--set", "workload.image_size=64", "--strategy", "fsdp",
                 "--cluster", "a100-80gb:1x2", "--batch", "8", "--json"]) == 0
    (memory,) = json.loads(capsys.readouterr().out)["estimates"]
    assert out["memory_per_rank"] == memory
    assert memory["ranks"][0]["bytes"]["parameters"] == pytest.approx(11_181_642 * 4 / 2, rel=1e-3)  # fp32, halved


def test_transformers_is_kept_from_importing_torchvision_which_still_imports_after() -> None:
    # torchvision imports torch._dynamo (a second of every hf: prediction); text models need none of it
    import subprocess
    import sys

    probe = ("import sys\n"
             "from ddlscope.workloads.sources import HFSpec, hf_decoder_facts, import_torchvision\n"
             "facts = hf_decoder_facts(HFSpec(name='hf:llama', hidden=64, heads=4, layers=2, intermediate=128))\n"
             "print('torchvision' in sys.modules, facts['layers'])\n"
             "print(import_torchvision().models.resnet18(num_classes=3).fc.out_features)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "2", "3"]


def test_a_mixture_of_experts_decoder_is_priced_with_its_experts(capsys) -> None:
    # Mixtral's config names 8 experts, 2 per token: the step model's parameters are the model's own
    from ddlscope.workloads.sources import HFSpec, hf_model

    sizes = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 96, "vocab": 100, "seq_len": 32}
    out = predicted(capsys, "--model", "hf:mixtral", "--hidden", "64", "--layers", "2", "--heads", "4",
                    "--kv-heads", "2", "--ffn-hidden", "96", "--vocab", "100", "--seq", "32", "--global-batch", "8",
                    "--cluster", "h100:1x8", "--ep", "8")
    import torch

    with torch.device("meta"):
        built = hf_model(HFSpec(name="hf:mixtral", **sizes))
    assert out["model"]["experts"] == 8 and out["model"]["top_k"] == 2 and out["model"]["gated_mlp"]
    # within 2%: the step model's layer has GPT's biases and LayerNorms, Mixtral's none and RMSNorms; one
    # expert instead of 8 would be 1.8x off at these sizes
    assert out["parameters"] == pytest.approx(sum(p.numel() for p in built.parameters()), rel=0.02)


def test_a_well_known_model_by_name_is_its_published_shape(capsys) -> None:
    common = ["--cluster", "h100:8x8", "--global-batch", "512", "--tp", "2"]
    preset = predicted(capsys, "--model", "llama3-8b", *common)
    explicit = predicted(capsys, "--model", "hf:llama", *LLAMA_8B, *common)
    assert preset["step_time_s"] == explicit["step_time_s"] and preset["parameters"] == explicit["parameters"]
    assert preset["preset"]["name"] == "llama3-8b" and "Llama 3 Herd" in preset["preset"]["source"]
    assert "preset" not in explicit
    assert predicted(capsys, "--model", "llama3-8b", "--layers", "2", *common)["model"]["layers"] == 2  # flags win
    # published totals: GPT-3 175B, Mixtral 8x7B 46.7B, Llama 3.1 405B (the step model has GPT's biases: 0.5%)
    for name, published, extra in (("gpt3-175b", 175e9, ["--pp", "8"]), ("mixtral-8x7b", 46.7e9, ["--pp", "8", "--ep", "8"]),
                                   ("llama3.1-405b", 405e9, ["--pp", "9", "--dp", "7"])):
        out = predicted(capsys, "--model", name, "--cluster", "h100:64x8", "--global-batch", "1008", "--tp", "8", *extra)
        assert out["parameters"] == pytest.approx(published, rel=0.005), name


@pytest.mark.parametrize("zero,strategy", [(0, "ddp"), (3, "fsdp")])
def test_a_decoders_prediction_holds_the_memory_command_figures(zero: int, strategy: str, capsys) -> None:
    sizes = {"hidden": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 256, "vocab": 500, "seq_len": 64}
    flags = ["--model", "hf:llama", "--hidden", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2",
             "--ffn-hidden", "256", "--vocab", "500", "--seq", "64", "--global-batch", "16", "--cluster", "h100:1x8"]
    out = predicted(capsys, *flags, "--zero", str(zero))
    assert main(["memory", "hf:llama", "--strategy", strategy, "--world-size", "8", "--batch", "16", "--cluster",
                 "h100:1x8", "--json", *[a for k, v in sizes.items() for a in ("--set", f"workload.{k}={v}")]]) == 0
    (estimate,) = json.loads(capsys.readouterr().out)["estimates"]
    assert out["memory_per_rank"] == estimate and estimate["strategy"] == strategy
    assert "memory_per_rank" not in predicted(capsys, *flags, "--tp", "2")  # no strategy is tensor parallel
