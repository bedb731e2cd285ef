"""Analysis of stored runs: summaries, breakdowns, speedups (no torch needed)."""
