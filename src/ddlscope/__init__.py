"""ddlscope: run, measure, explain and predict distributed deep-learning training.

The library API for a training loop ddlscope did not write (docs/attach.md):

    meter = ddlscope.attach(model, optimizer, run="my-job")
    with meter.step(samples=len(x)) as step: ...
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "attach"]


def __getattr__(name: str) -> Any:
    # The public API is imported on first use: every ddlscope module imports this package, and most
    # (specs, predict, the CLI's start-up) must not pay for torch.distributed's runtime.
    if name in ("attach", "AttachError", "Meter"):
        from ddlscope.runtime import attach as module

        return getattr(module, name)
    raise AttributeError(f"module 'ddlscope' has no attribute {name!r}")
