"""The data settings (`data.*` in the Hydra config) and their validation."""

from dataclasses import dataclass, field
from typing import Literal

from scalevec_train.errors import ScalevecError, check_choices, choice

EMBEDDED = ("stdlib", "python_env")  # sources that read the running Python's files, so take no data.path


@dataclass
class DataConfig:
    # stdlib (the running Python's standard library source, about 10M tokens) | python_env (the standard
    # library plus every package installed beside it, site-packages) | text_dir | hf (a `datasets`
    # dataset) | shards (a folder prepared earlier)
    source: str = choice("stdlib", Literal["stdlib", "python_env", "text_dir", "hf", "shards"])
    # text_dir: folder of text files; hf: dataset name or local path; shards: prepared folder
    path: str = ""
    # text_dir only: file-name patterns searched in all subfolders; each file is one document
    patterns: list[str] = field(default_factory=lambda: ["*.txt", "*.md", "*.rst", "*.py"])
    # hf only: the column that holds the text
    text_field: str = "text"
    # hf only: the dataset's configuration (subset) name; empty for the default one
    hf_config: str = ""
    # hf only: the split to read (a single local jsonl/parquet/arrow file is always "train")
    hf_split: str = "train"
    # hf only: stream rows instead of downloading the whole dataset first
    streaming: bool = False
    # use at most this many bytes of text, whole documents in corpus order (0: all of it)
    max_corpus_bytes: int = 0
    # share of documents held out for validation, chosen deterministically by document
    val_fraction: float = 0.02
    # tokenizer vocab size; YAML presets set it to ${model.vocab_size}
    vocab_size: int = 4096
    # an existing tokenizer to use instead of training one (empty: train one): a SentencePiece model, or a
    # Hugging Face tokenizer.json (or a folder holding one) whose end-of-document token is a special
    # token named </s>, <|endoftext|>, <|end_of_text|> or <eos>
    tokenizer_path: str = ""
    # SentencePiece model type when training: bpe | unigram (unigram trains about 10x slower)
    tokenizer_type: str = choice("bpe", Literal["bpe", "unigram"])
    # tokenizer training reads at most this many bytes of training text
    tokenizer_train_bytes: int = 16_000_000
    # tokens per shard file (the last shard of each part shorter)
    shard_tokens: int = 1 << 26
    # processes that encode documents (0: the cores this process may use, shared among the processes of
    # a node when the preparation itself runs under torchrun); the shards are the same for any number
    num_workers: int = 0
    # documents are prepared in parts of about this many bytes of text (a part ends with the document
    # that reaches it), in corpus order: the unit of work that preparation under torchrun or a SLURM array
    # deals out, and the unit a killed preparation resumes from. Where a part ends, a shard ends. Not
    # part of the cache key: it moves shard boundaries but never changes the token stream.
    part_bytes: int = 1 << 27
    # where tokenizers and prepared shards are cached (relative to the working directory)
    cache_dir: str = "data_cache"

    def validate(self) -> None:
        check_choices(self, "data.")
        if self.source in EMBEDDED and self.path:
            raise ScalevecError("data.path", f"is set ({self.path!r}) but data.source={self.source} ignores it.",
                                "pick the source that reads it (data=text_dir, data=hf, data=shards) "
                                "or clear data.path.")
        if self.source not in EMBEDDED and not self.path:
            raise ScalevecError("data.path", f"data.source={self.source} needs a path.",
                                f"pass data.path=... ({_PATH_HELP[self.source]}).")
        if self.source == "text_dir" and not self.patterns:
            raise ScalevecError("data.patterns", "is empty, so no file can match.",
                                "list file-name patterns such as ['*.txt'].")
        if self.source == "hf" and not self.text_field:
            raise ScalevecError("data.text_field", "is empty.", "name the column that holds the text.")
        if not 0.0 < self.val_fraction < 1.0:
            raise ScalevecError("data.val_fraction", f"{self.val_fraction} is outside (0, 1).",
                                "hold out a small share of documents, e.g. 0.02.")
        if self.max_corpus_bytes < 0:
            raise ScalevecError("data.max_corpus_bytes", f"{self.max_corpus_bytes} is negative.",
                                "use 0 for no limit.")
        if self.vocab_size < 1:
            raise ScalevecError("data.vocab_size", f"{self.vocab_size} is not positive.")
        if self.tokenizer_train_bytes < 1:
            raise ScalevecError("data.tokenizer_train_bytes",
                                f"{self.tokenizer_train_bytes} is not positive.")
        if self.shard_tokens < 1:
            raise ScalevecError("data.shard_tokens", f"{self.shard_tokens} is not positive.")
        if self.num_workers < 0:
            raise ScalevecError("data.num_workers", f"{self.num_workers} is negative.",
                                "use 0 for every available core, or a number of processes.")
        if self.part_bytes < 1:
            raise ScalevecError("data.part_bytes", f"{self.part_bytes} is not positive.")
        if not self.cache_dir:
            raise ScalevecError("data.cache_dir", "is empty.", "name a folder for the data cache.")


_PATH_HELP = {
    "text_dir": "a folder of text files",
    "hf": "a dataset name or a local jsonl/parquet/arrow file or folder",
    "shards": "a folder prepared earlier, holding its tokenizer, train/ and val/",
}
