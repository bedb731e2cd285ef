"""`plan`: score every valid parallel configuration at once and rank what fits.

The search space is TP x CP x PP x DP x micro-batch x ZeRO stage x
recomputation x sequence parallelism x interleaving x schedule (x EP for a
mixture of experts), built as flat numpy arrays
(a Cartesian product, then the validity mask) and scored by
`model.evaluate` in one vectorized call per cluster size: no Python loop per
configuration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from ddlscope.predict.catalogue import Cluster, Stack, make_cluster
from ddlscope.predict.model import BREAKDOWN_KEYS, ConfigArrays, evaluate, valid_mask
from ddlscope.predict.predictor import prediction_from_arrays, validate_model, with_ranges
from ddlscope.predict.specs import RECOMPUTE_CODES, ModelSpec, Prediction
from ddlscope.specs import ConfigError

RankBy = Literal["time", "cost"]
MAX_MICRO_BATCH = 64
MAX_INTERLEAVE = 8
MAX_EXPERT_PARALLEL = 64

TERM_LABELS = {"compute_s": "compute", "tp_comm_s": "TP comm", "ep_comm_s": "expert all-to-all",
               "cp_comm_s": "context-parallel ring", "pp_p2p_s": "PP send/recv",
               "zero_comm_s": "ZeRO gathers", "dp_sync_s": "DP grad sync", "embedding_sync_s": "embedding sync",
               "bubble_s": "pipeline bubble", "optimizer_s": "optimizer", "grad_accumulation_s": "gradient accumulation"}


@dataclass
class PlanRow:
    rank: int
    prediction: Prediction
    why: str


@dataclass
class PlanResult:
    cluster: str
    rank_by: str
    evaluated: int  # valid configurations scored
    feasible: int  # of those, the ones that fit in memory
    search_s: float
    rows: list[PlanRow] = field(default_factory=list)

    @property
    def configs_per_s(self) -> float:
        return self.evaluated / self.search_s if self.search_s > 0 else float("inf")


def divisors(n: int, at_most: int | None = None) -> list[int]:
    """The divisors of n, up to `at_most` (all of them by default)."""
    return [k for k in range(1, min(n, at_most if at_most is not None else n) + 1) if n % k == 0]


def candidate_configs(model: ModelSpec, cluster: Cluster, max_micro_batch: int = MAX_MICRO_BATCH,
                      max_interleave: int = MAX_INTERLEAVE) -> ConfigArrays:
    """Every valid configuration for this model on exactly this cluster, as arrays, in the order of the
    product TP x CP x PP (x DP) x micro-batch x ZeRO x recomputation x SP x interleaving x schedule x EP.

    The product is built in three steps, each pruned by `valid_mask` before the next multiplies it
    (the same configurations as pruning the whole product once, a fraction of the work): the sizes and
    the micro-batch, most of whose combinations do not divide the batch, with every other knob at a
    value no rule refuses (no SP, no interleaving, 1F1B, EP 1); then SP, interleaving, schedule and EP
    for each; then the ZeRO stage and recomputation, which no rule restricts, for each of those."""
    n = cluster.n_gpus
    cps = [c for c in (1, 2, 4, 8, 16, 32) if c <= n and (c == 1 or model.attention == "flash")
           and model.seq % (2 * c) == 0]
    triples = [(t, c, p) for t in divisors(n) if model.heads % t == 0 and model.kv % t == 0
               for c in cps if (n // t) % c == 0
               for p in divisors(n // (t * c)) if model.layers % p == 0]
    if not triples:
        z = np.zeros(0, dtype=int)
        return ConfigArrays.with_defaults(tp=z, pp=z, dp=z, micro_batch=z)
    tp, cp, pp = (np.array(column) for column in zip(*triples))
    micro = np.array(divisors(model.global_batch, max_micro_batch))  # not a loop to a huge batch
    index, b = (a.ravel() for a in np.meshgrid(np.arange(len(triples)), micro, indexing="ij"))
    sizes = ConfigArrays.with_defaults(tp=tp[index], pp=pp[index], dp=n // (tp[index] * cp[index] * pp[index]),
                                       micro_batch=b, cp=cp[index])
    sizes = sizes.take(valid_mask(model, cluster, sizes))

    interleave = np.array(divisors(model.layers, max_interleave))
    eps = np.array(divisors(model.experts, MAX_EXPERT_PARALLEL) if model.is_moe else [1])
    row, sp, v, sched, ep = (a.ravel() for a in np.meshgrid(np.arange(len(sizes)), np.array([False, True]),
                                                            interleave, np.arange(2), eps, indexing="ij"))
    knobs = ConfigArrays.with_defaults(tp=sizes.tp[row], pp=sizes.pp[row], dp=sizes.dp[row],
                                       micro_batch=sizes.micro_batch[row], cp=sizes.cp[row], sequence_parallel=sp,
                                       interleave=v, schedule=sched, ep=ep)
    distinct = (knobs.schedule == 0) | (knobs.pp > 1)  # without a pipeline GPipe and 1F1B are the same run
    keep = valid_mask(model, cluster, knobs) & distinct
    return _times_zero_and_recompute(knobs.take(keep), np.bincount(row[keep], minlength=len(sizes)))


def _times_zero_and_recompute(c: ConfigArrays, per_size: np.ndarray) -> ConfigArrays:
    """Each configuration of `c` at every ZeRO stage (0-3) and recomputation (0-2), in product order:
    `c` holds `per_size[i]` configurations for the i-th size (consecutive), and the stages and
    recomputations go between the size and those, as their axes do in the product."""
    stages = 4 * len(RECOMPUTE_CODES)
    block = np.repeat(per_size, stages)  # one block of the size's configurations per (stage, recomputation)
    size = np.repeat(np.arange(len(per_size)), per_size * stages)
    first_of_size = np.concatenate(([0], np.cumsum(per_size)[:-1]))
    at = np.arange(int(block.sum())) - np.repeat(np.concatenate(([0], np.cumsum(block)[:-1])), block)
    combo = np.repeat(np.arange(len(block)) % stages, block)
    out = c.take(first_of_size[size] + at)
    out.zero, out.recompute = combo // len(RECOMPUTE_CODES), combo % len(RECOMPUTE_CODES)
    return out


def plan(model: ModelSpec, cluster: Cluster, top: int = 5, rank_by: RankBy = "time", spot: bool = False,
         max_micro_batch: int = MAX_MICRO_BATCH, overlap_grad_reduce: bool = True,
         fused_grad_accumulation: bool = False, stack: Stack | None = None,
         grad_reduce_bytes: int = 2, fused_rope: bool = True, fused_elementwise: bool = True,
         distinct_layouts: bool = True, fsdp_version: int | None = None) -> PlanResult:
    """The `top` fastest (or cheapest per step) configurations that fit, each with why it beats the next.

    `distinct_layouts` (the default): each layout (TP x CP x PP x DP x EP on a node count) once, at its best
    micro-batch, ZeRO stage, recomputation, SP, interleaving and schedule: the same split of the cluster at ZeRO
    1 and ZeRO 0 (a step 0.01 s apart) is one choice to a user, not two rows; `why` then compares layouts.
    Where fewer layouts fit than `top`, every configuration is ranked instead (rows of one layout included).

    Ranking by cost also tries every smaller whole number of nodes that divides
    the cluster: fewer GPUs can cost less per step even when each step is slower.
    `overlap_grad_reduce` and `fused_grad_accumulation` describe the software stack (ParallelSpec):
    they hold for every configuration searched, not searched over. `stack` (catalogue.toml [stacks]) keeps
    only the layouts that stack can run (its ZeRO stages, pipeline engine, TP / SP / CP, selective
    recomputation); its figure and switches are the caller's to apply (`predictor.with_stack`), except
    `fsdp_version`, which is the stack's where not given (0 without a stack).
    """
    if rank_by not in ("time", "cost"):
        raise ConfigError(f"by = {rank_by!r}: allowed: time, cost")
    if top < 1:
        raise ConfigError(f"top = {top}: must be >= 1")
    if max_micro_batch < 1:
        raise ConfigError(f"max_micro_batch = {max_micro_batch}: must be >= 1")
    validate_model(model, cluster)  # the checks `predict` makes of the model, before searching
    start = time.perf_counter()
    node_counts = divisors(cluster.nodes) if rank_by == "cost" else [cluster.nodes]
    scored: list[tuple[Cluster, ConfigArrays, dict[str, np.ndarray]]] = []
    evaluated = 0
    for nodes in node_counts:
        # a smaller cluster of the same nodes keeps the device as given (a stack's or the user's figure)
        sub = cluster if nodes == cluster.nodes else replace(
            make_cluster(cluster.name, nodes, cluster.gpus_per_node), device=cluster.device,
            published_share_low=cluster.published_share_low, stack_share=cluster.stack_share)
        configs = candidate_configs(model, sub, max_micro_batch)
        if stack is not None:
            configs = configs.take(stack.allowed(configs.tp, configs.pp, configs.cp, configs.zero, configs.recompute,
                                                 configs.sequence_parallel, configs.interleave, configs.schedule))
        configs.overlap_grad_reduce, configs.fused_grad_accumulation = overlap_grad_reduce, fused_grad_accumulation
        configs.grad_reduce_bytes, configs.fused_rope = grad_reduce_bytes, fused_rope
        configs.fused_elementwise = fused_elementwise
        configs.fsdp_version = fsdp_version if fsdp_version is not None else (
            (stack.fsdp_version or 0) if stack is not None else 0)
        if len(configs):
            scored.append((sub, configs, evaluate(model, sub, configs)))
            evaluated += len(configs)
    search_s = time.perf_counter() - start

    cost_key = "spot_cost_usd" if spot else "cost_usd"
    key = "step_time_s" if rank_by == "time" else cost_key
    feasible = int(sum(int(np.count_nonzero(out["fits"])) for _, _, out in scored))
    if not feasible:
        return PlanResult(str(cluster), rank_by, evaluated, 0, search_s)
    # fewer layouts fit than rows asked for (an FSDP-only stack on one node has one): every configuration
    distinct_layouts = distinct_layouts and _fitting_layouts(scored) >= top
    order = _best_first(scored, key, top + 1, distinct_layouts)
    rows = []
    for r, (k, i) in enumerate(order[:top]):
        sub, configs, out = scored[k]
        pred = with_ranges(prediction_from_arrays(out, i, model, configs.spec(i), sub, spot), model, sub,
                           configs.take(np.array([i])))
        runner_up = order[r + 1] if r + 1 < len(order) else None
        why = (_why(scored, (k, i), runner_up, key) if runner_up
               else f"no other {'layout' if distinct_layouts else 'configuration'} fits")
        rows.append(PlanRow(rank=r + 1, prediction=pred, why=why))
    return PlanResult(str(cluster), rank_by, evaluated, feasible, search_s, rows)


LAYOUT_FIELDS = ("tp", "cp", "pp", "dp", "ep")


def _layouts(scored) -> np.ndarray:
    """One row per configuration of `scored`: its cluster's index, then its LAYOUT_FIELDS."""
    owner = np.concatenate([np.full(len(c), k) for k, (_, c, _) in enumerate(scored)])
    return np.stack([owner, *(np.concatenate([getattr(c, name) for _, c, _ in scored]).astype(np.int64)
                              for name in LAYOUT_FIELDS)], axis=1)


def _fitting_layouts(scored) -> int:
    fits = np.concatenate([out["fits"] for _, _, out in scored])
    return len(np.unique(_layouts(scored)[fits], axis=0))


def _best_first(scored, key: str, count: int, distinct_layouts: bool = False) -> list[tuple[int, int]]:
    """Indices (cluster k, config i) of the `count` best fitting configurations (`distinct_layouts`: the best
    of each layout, the first `count` layouts).

    Equal scores (to 1e-9 relative) go to the one needing less memory, then fewer GPUs, then the
    earlier in the search's order: argpartition's order among equals differs between CPUs (its
    SIMD paths), so without the last key two equal layouts swapped places from machine to machine.
    """
    values = np.concatenate([np.where(out["fits"], out[key], np.inf) for _, _, out in scored])
    memory = np.concatenate([out["memory_bytes"] for _, _, out in scored])
    owner = np.concatenate([np.full(len(out[key]), k) for k, (_, _, out) in enumerate(scored)])
    local = np.concatenate([np.arange(len(out[key])) for _, _, out in scored])
    layout = _layouts(scored)
    count = min(count, int(np.isfinite(values).sum()))
    # take a generous slice by score, then order it with the tie-breaks; a larger one while it holds
    # fewer than `count` layouts
    pool = min(len(values), count * 8)
    while True:
        best = np.argpartition(values, pool - 1)[:pool] if pool < len(values) else np.arange(len(values))
        best = best[np.isfinite(values[best])]
        rounded = np.round(values[best] / values[best].min(), 9)
        # whole bytes: sums in another order (another CPU's SIMD path) must not reorder equal layouts
        best = best[np.lexsort((local[best], owner[best], np.round(memory[best]), rounded))]
        if distinct_layouts:  # the first (best) row of each layout, in that order
            _, first = np.unique(layout[best], axis=0, return_index=True)
            best = best[np.sort(first)]
        if len(best) >= count or pool == len(values):
            break
        pool = min(len(values), pool * 8)
    return [(int(owner[j]), int(local[j])) for j in best[:count]]


def _why(scored, winner: tuple[int, int], runner_up: tuple[int, int], key: str) -> str:
    """Which terms of the step make `winner` beat `runner_up`, largest first."""
    (kw, iw), (kr, ir) = winner, runner_up
    ow, orr = scored[kw][2], scored[kr][2]
    margin = float(orr[key][ir] - ow[key][iw])
    money = key != "step_time_s"
    spec_r = scored[kr][1].spec(ir)
    where = f" on {scored[kr][0]}" if kr != kw else ""
    lead = f"beats next ({spec_r.label()}{where}) by " + (f"${margin:.3g}/step" if money else f"{margin:.3g} s")
    deltas = [(float(orr[t][ir] - ow[t][iw]), t) for t in BREAKDOWN_KEYS]
    saves = sorted(((d, t) for d, t in deltas if d > 1e-6), reverse=True)[:2]
    spends = sorted(((-d, t) for d, t in deltas if d < -1e-6), reverse=True)[:1]
    dominant = max((float(ow[t][iw]), t) for t in BREAKDOWN_KEYS)[1]
    parts = []
    if saves:
        parts.append("less " + ", ".join(f"{TERM_LABELS[t]} (-{d:.3g} s)" for d, t in saves))
    if spends:
        parts.append("more " + ", ".join(f"{TERM_LABELS[t]} (+{d:.3g} s)" for d, t in spends))
    if money and int(scored[kw][0].n_gpus) != int(scored[kr][0].n_gpus):
        parts.append(f"{scored[kw][0].n_gpus} vs {scored[kr][0].n_gpus} GPUs")
    if not parts:
        saved_gb = float(orr["memory_bytes"][ir] - ow["memory_bytes"][iw]) / 1e9
        parts.append(f"same step time, {saved_gb:.3g} GB less memory per GPU" if saved_gb > 1e-6 else "same step time")
    detail = "; ".join(parts)
    return f"{lead}: {detail}; {TERM_LABELS[dominant]} dominates its step"
