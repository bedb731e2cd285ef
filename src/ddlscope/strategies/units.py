"""FSDP's wrap units: the model's repeated blocks (workloads/blocks.py, where the rule lives, so that
workloads can recompute per block and strategies shard per block with one rule)."""

from ddlscope.workloads.blocks import repeated_block_classes, wrap_units

__all__ = ["repeated_block_classes", "wrap_units"]
