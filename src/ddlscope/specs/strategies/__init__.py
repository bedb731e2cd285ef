"""One module per strategy spec; importing this package registers them all (specs/strategy.py)."""
