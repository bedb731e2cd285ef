#!/usr/bin/env bash
# One prepared check for a session that is lent a GPU (the device tool; 15 minutes in all).
#
# What it does, in this order, each step allowed to fail without stopping the rest:
#   1. the environment: torch, CUDA, the GPU's name
#   2. the tests that touch CUDA-aware code paths (device choice, FSDP mixed precision, memory stats)
#   3. one rank of ddp and of fsdp on the GPU (NCCL, CUDA memory stats): gpt-synthetic, h 1024,
#      8 layers, 16 heads, seq 512 (HIDDEN, LAYERS, HEADS, SEQ), batch 16, 20 steps; the summaries as JSON
#   4. `ddlscope predict` of the same shape on h200:1x1 (fp32: the runs do not use mixed precision),
#      beside the measured step time
#   5. benchmarks/kernel_rates.py: each kernel kind of a transformer step (GEMMs at the published runs'
#      layer shapes, unfused softmax + dropout, FlashAttention, element-wise passes, copy, fused AdamW,
#      and whole GPT blocks forward + backward) timed on the GPU beside the model's price for it
#      (about 2 minutes)
#   6. docs/profile.md on the GPU: `calibrate --model` of 3 models (the GPT above, resnet-cifar at width 64,
#      hf:llama at hidden 512) beside one rank of ddp run for real: the layers' sum vs the whole step
#      (per-layer overhead), and the profile's forward + backward vs the run's measured ones
#
# On the device machine (python3 there holds a CUDA torch; pydantic may have to travel as wheels
# in .whl, see the device tool's README):
#     bash benchmarks/gpu_check.sh            # results under $OUT
# Here, to check the script itself on the CPU (a small shape: the GPU's takes a minute a step here):
#     DEVICE=cpu PY=.venv/bin/python HIDDEN=128 LAYERS=2 HEADS=4 SEQ=64 STEPS=4 bash benchmarks/gpu_check.sh
set -uo pipefail
PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
STEPS=${STEPS:-20}
HIDDEN=${HIDDEN:-1024} LAYERS=${LAYERS:-8} HEADS=${HEADS:-16} SEQ=${SEQ:-512}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

echo "== 1. environment"
"$PY" -c 'import torch; ok = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", ok, torch.cuda.get_device_name(0) if ok else "-")'

echo "== 2. tests with CUDA-aware paths"
timeout 240 "$PY" -m pytest -q -x -p no:cacheprovider tests/test_fsdp.py tests/test_flops.py 2>&1 | tail -5

echo "== 3. one rank of ddp and fsdp on $DEVICE"
SHAPE=(--set workload.hidden="$HIDDEN" --set workload.layers="$LAYERS" --set workload.heads="$HEADS" --set workload.seq_len="$SEQ")
for strategy in ddp fsdp; do
    timeout 240 "$PY" -m ddlscope run -w gpt-synthetic -s "$strategy" -n 1 --steps "$STEPS" --batch-size 16 \
        --set cluster.device="$DEVICE" "${SHAPE[@]}" --db "$OUT/gpu.db" --json -q > "$OUT/$strategy.json" \
        || echo "$strategy run failed"
    "$PY" - "$OUT/$strategy.json" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(0)
mem = s.get("memory_bytes_by_rank", {}).get("0", {})
print(f"{sys.argv[1]}: step {s['mean_step_s'] * 1e3:.2f} ms, MFU {s.get('mfu')}, breakdown (ms) "
      f"{ {k: round(v * 1e3, 2) for k, v in s['breakdown_mean_s'].items()} }, memory {mem}")
EOF
done

echo "== 4. predicted for the same shape on h200:1x1 (fp32)"
"$PY" -m ddlscope predict --cluster h200:1x1 --model gpt --hidden "$HIDDEN" --heads "$HEADS" --layers "$LAYERS" --seq "$SEQ" \
    --vocab 256 --global-batch 16 --micro-batch 16 --dp 1 --dtype fp32 --attention flash --json > "$OUT/predicted.json"
"$PY" - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
p = json.load(open(f"{out}/predicted.json"))
print(f"predicted step {p['step_time_s'] * 1e3:.2f} ms, MFU {p['mfu']:.3f}, memory {p['memory_gb_per_gpu']:.2f} GB")
try:
    m = json.load(open(f"{out}/ddp.json"))
    print(f"ddp measured {m['mean_step_s'] * 1e3:.2f} ms: error {p['step_time_s'] / m['mean_step_s'] - 1:+.1%}")
except (OSError, ValueError, KeyError):
    pass
EOF

echo "== 5. the model's kernel prices against this GPU (benchmarks/kernel_rates.py; issue 23)"
if [ "$DEVICE" = cuda ]; then
    timeout 180 "$PY" benchmarks/kernel_rates.py --json "$OUT/kernels.json" 2>&1 | grep -v "^USDT:" | tail -100 || echo "kernel check failed"
else
    timeout 180 "$PY" benchmarks/kernel_rates.py --device cpu --against h100 --quick --json "$OUT/kernels.json" \
        2>&1 | tail -8 || echo "kernel check failed"
fi
echo "== 6. model profiles (calibrate --model) vs one measured rank (docs/profile.md)"
MODELS=("gpt-synthetic ${SHAPE[*]}"
        "resnet-cifar --set workload.width=64 --set workload.blocks=2 --set workload.batch_size=64"
        "hf:llama --set workload.hidden=512 --set workload.layers=4 --set workload.heads=8 --set workload.seq_len=256")
for i in "${!MODELS[@]}"; do
    read -r -a M <<< "${MODELS[$i]}"
    timeout 120 "$PY" -m ddlscope calibrate --model "${M[@]}" --repeats 10 -o "$OUT/profile$i.json" > /dev/null \
        || { echo "${M[0]}: profile failed"; continue; }
    timeout 120 "$PY" -m ddlscope run -w "${M[@]}" -s ddp -n 1 --steps "$STEPS" --set cluster.device="$DEVICE" \
        --db "$OUT/gpu.db" --json -q > "$OUT/run$i.json" || echo "${M[0]}: run failed"
    "$PY" - "$OUT/profile$i.json" "$OUT/run$i.json" <<'EOF'
import json, sys
p = json.load(open(sys.argv[1]))
step = p["step"]["forward_s"] + p["step"]["backward_s"]
print(f"{p['workload']['name']} on {p['device']['name']} ({p['split'][:40]}): {len(p['layers']['name'])} pieces sum "
      f"{p['layers_sum_s'] * 1e3:.2f} ms, whole step {step * 1e3:.2f} ms, overhead {p['overhead_s'] * 1e3:+.2f} ms"
      + (f", their CUDA kernels {p['layers_kernel_s'] * 1e3:.2f} ms" if "layers_kernel_s" in p else ""))
try:
    b = json.load(open(sys.argv[2]))["breakdown_mean_s"]
    run = b["forward_s"] + b["backward_s"]
    print(f"  measured rank forward + backward {run * 1e3:.2f} ms: profile {step / run - 1:+.1%}, layers' sum "
          f"{p['layers_sum_s'] / run - 1:+.1%}")
except (OSError, ValueError, KeyError):
    pass
EOF
done
echo "results in $OUT"
