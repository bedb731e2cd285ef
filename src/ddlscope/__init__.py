"""ddlscope: run, measure, explain and predict distributed deep-learning training."""

__version__ = "0.1.0"
