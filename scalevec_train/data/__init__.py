"""Data: corpus -> SentencePiece tokenizer -> token shards -> deterministic, resumable batches."""

from scalevec_train.data.config import DataConfig
from scalevec_train.data.loader import TokenLoader
from scalevec_train.data.prepare import PreparedData, check_vocab, open_prepared, prepare_data

__all__ = ["DataConfig", "PreparedData", "TokenLoader", "check_vocab", "open_prepared", "prepare_data"]
