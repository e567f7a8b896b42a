"""Data: corpus -> tokenizer (SentencePiece, or a Hugging Face tokenizer.json) -> token shards,
prepared by every core of one or many nodes -> deterministic, resumable batches."""

from scalevec_train.data.config import DataConfig
from scalevec_train.data.prepare import PreparedData, check_vocab, open_prepared
from scalevec_train.data.sources import prepare_data, prepare_share

__all__ = ["DataConfig", "PreparedData", "TokenLoader", "check_vocab", "open_prepared",
           "prepare_data", "prepare_share"]


def __getattr__(name: str):
    # The loader needs torch; preparation does not, and its worker processes start faster without
    # it.
    if name == "TokenLoader":
        from scalevec_train.data.loader import TokenLoader

        return TokenLoader
    raise AttributeError(f"module 'scalevec_train.data' has no attribute {name!r}")
