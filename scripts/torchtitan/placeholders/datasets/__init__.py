"""Stands in for Hugging Face `datasets` where it is not installed (the GPU host has none and no
registry). torchtitan's Llama 3 module imports its text loaders, and through them these names, at
import time; the benchmark's spec (scalevec_llama) feeds random tokens and never calls them.
scripts/bench_torchtitan.py puts this folder on the path only when the real package is missing."""


def _absent(*args, **kwargs):
    raise RuntimeError("Hugging Face datasets is not installed here; scalevec's torchtitan "
                       "benchmark uses random tokens and must not reach a torchtitan text loader.")


class Dataset:
    def __init__(self, *args, **kwargs):
        _absent()


load_dataset = _absent
