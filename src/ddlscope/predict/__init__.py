"""Predict distributed training time, memory, energy and cost from specs alone (no torch).

    from ddlscope.predict import ModelSpec, ParallelSpec, parse_cluster, predict
    cluster = parse_cluster("a100-80gb:280x8")
    gpt = ModelSpec(hidden=20480, heads=128, layers=105, seq=2048, vocab=51200, global_batch=1920)
    predict(gpt, ParallelSpec(tp=8, pp=35, dp=8, recompute="full"), cluster).step_time_s

See docs/predict.md for the equations and their sources.
"""

from ddlscope.predict.catalogue import (Cluster, ClusterStringError, Device, Link, Stack, get_stack, load_catalogue,
                                        parse_cluster, stack_names)
from ddlscope.predict.predictor import fit_sustained_fraction, fitted_prediction, predict, validate, with_stack
from ddlscope.predict.specs import ModelSpec, ParallelSpec, Prediction

__all__ = ["Cluster", "ClusterStringError", "Device", "Link", "ModelSpec", "ParallelSpec", "Prediction", "Stack",
           "fit_sustained_fraction", "fitted_prediction", "get_stack", "load_catalogue", "parse_cluster", "predict",
           "stack_names", "validate", "with_stack"]
