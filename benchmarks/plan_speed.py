"""How fast does `ddlscope plan` search? A 1T-parameter GPT on 3072 A100s.

The model is Megatron-LM's 1T configuration (Narayanan et al. 2021): hidden
25600, 160 heads, 128 layers, sequence 2048, vocabulary 51200; global batch
1536 sequences; cluster a100-80gb:384x8. The planner enumerates every valid
TP x PP x DP x micro-batch x ZeRO x recompute x SP x interleave x schedule
combination as numpy arrays and scores them in one vectorized call.

Prints the configurations scored per second and the whole search time
(enumeration + scoring + ranking), best and median of --repeats runs.
Target (issue 23): >= 1,000,000 configurations/s and the whole search under 1 s.

    .venv/bin/python benchmarks/plan_speed.py [--repeats 5] [--top 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from ddlscope.predict import ModelSpec, parse_cluster
from ddlscope.predict.planner import plan

TARGET_CONFIGS_PER_S = 1_000_000
TARGET_TOTAL_S = 1.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=1536)
    args = parser.parse_args()

    model = ModelSpec(hidden=25600, heads=160, layers=128, seq=2048, vocab=51200, global_batch=args.global_batch)
    cluster = parse_cluster("a100-80gb:384x8")
    plan(model, cluster, top=args.top)  # warm-up: imports, catalogue, numpy caches

    totals, searches, rates, result = [], [], [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = plan(model, cluster, top=args.top)
        totals.append(time.perf_counter() - start)
        searches.append(result.search_s)
        rates.append(result.configs_per_s)
    assert result is not None

    print(f"model: GPT {model.params / 1e12:.2f}T parameters (h {model.hidden}, {model.heads} heads, "
          f"{model.layers} layers, seq {model.seq}, vocab {model.vocab}, global batch {model.global_batch})")
    print(f"cluster: {cluster} ({cluster.n_gpus} GPUs)")
    print(f"configurations scored: {result.evaluated:,} valid ({result.feasible:,} fit in memory)")
    print(f"scoring rate: best {max(rates):,.0f} configs/s, median {statistics.median(rates):,.0f} configs/s "
          f"(target >= {TARGET_CONFIGS_PER_S:,})")
    print(f"whole search (enumerate + score + rank + explain): best {min(totals) * 1e3:.1f} ms, "
          f"median {statistics.median(totals) * 1e3:.1f} ms (target < {TARGET_TOTAL_S * 1e3:.0f} ms)")
    for row in result.rows:
        p = row.prediction
        q = p.parallel
        print(f"  #{row.rank} TP{q['tp']} PP{q['pp']} DP{q['dp']} mb{q['micro_batch']} ZeRO-{q['zero']} "
              f"{q['recompute']}{' SP' if q['sequence_parallel'] else ''} v{q['interleave']} {q['schedule']}: "
              f"{p.step_time_s:.2f} s/step, {p.tflops_per_gpu:.0f} TFLOP/s/GPU, {p.memory_gb_per_gpu:.1f} GB")
    ok = statistics.median(rates) >= TARGET_CONFIGS_PER_S and statistics.median(totals) < TARGET_TOTAL_S
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
