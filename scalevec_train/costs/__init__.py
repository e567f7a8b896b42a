"""What a run costs: parameters and FLOPs, activation and per-rank memory, communication, and
describe's report."""
