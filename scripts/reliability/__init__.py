"""The parts of scripts/bench_reliability.py: the processes, the soak, the faults, bad input,
security."""
