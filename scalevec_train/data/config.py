"""The data settings (`data.*` in the Hydra config) and their validation."""

import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from scalevec_train.infra.errors import ScalevecError, check_choices, choice

# sources that read the running Python's files, so take no data.path
EMBEDDED = ("stdlib", "python_env")
_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a source name is a metric-key suffix: val_loss/<name>


@dataclass
class SourceOptions:
    """What one source reads: the single source of `data.*`, or one entry of data.mixture."""

    # stdlib (the running Python's standard library source, about 10M tokens) | python_env (the
    # standard library plus every package installed beside it, site-packages) | text_dir | hf (a
    # `datasets` dataset) | shards (a folder prepared earlier)
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


@dataclass
class MixtureSource(SourceOptions):
    """One source of a mixture (data.mixture): its SourceOptions, a name and a weight; everything
    else (tokenizer, shard size, workers, cache) is shared."""

    # names the source in metrics (val_loss/<name>, epochs/<name>): letters, digits, _ . -; unique
    name: str = ""
    # relative share of training samples (the weights need not sum to 1)
    weight: float = 1.0
    # train on at most this many tokens of the source's training split, repeating them (0: all of
    # it)
    max_tokens: int = 0


@dataclass
class DataConfig(SourceOptions):
    # tokenizer vocab size; YAML presets set it to ${model.vocab_size}
    vocab_size: int = 4096
    # an existing tokenizer to use instead of training one (empty: train one): a SentencePiece
    # model, or a Hugging Face tokenizer.json (or a folder holding one) whose end-of-document token
    # is a special token named </s>, <|endoftext|>, <|end_of_text|> or <eos>
    tokenizer_path: str = ""
    # SentencePiece model type when training: bpe | unigram (unigram trains about 10x slower)
    tokenizer_type: str = choice("bpe", Literal["bpe", "unigram"])
    # tokenizer training reads at most this many bytes of training text
    tokenizer_train_bytes: int = 16_000_000
    # tokens per shard file (the last shard of each part shorter)
    shard_tokens: int = 1 << 26
    # processes that encode documents (0: the cores this process may use, shared among the processes
    # of a node when the preparation itself runs under torchrun); the shards are the same for any
    # number
    num_workers: int = 0
    # documents are prepared in parts of about this many bytes of text (a part ends with the
    # document that reaches it), in corpus order: the unit of work that preparation under torchrun
    # or a SLURM array deals out, and the unit a killed preparation resumes from. Where a part ends,
    # a shard ends. Not part of the cache key: it moves shard boundaries but never changes the token
    # stream.
    part_bytes: int = 1 << 27
    # where tokenizers and prepared shards are cached (relative to the working directory)
    cache_dir: str = "data_cache"
    # check every token shard against the checksum its manifest recorded at preparation when a run
    # starts (each rank reads a share of the shards once); a mismatch refuses the run, naming the
    # shard. false: read them unchecked (shards you trust, or too many to read at every start)
    verify: bool = True
    # several sources instead of one (empty: the single source above): each entry a MixtureSource,
    # e.g. [{name: code, source: stdlib, weight: 3}, {name: docs, source: text_dir, path: docs,
    # weight: 1}]. data.source, data.path and the other source-specific options above then go
    # unused. All sources share one tokenizer: data.tokenizer_path, or one trained on the sources'
    # training text in proportion to their weights. docs/guides/data.md: how samples are drawn, and
    # what val_loss means for a mixture.
    mixture: list[MixtureSource] = field(default_factory=list)
    # warn at the start when the run would go over the training data (with a mixture: over any one
    # source's) more than this many times: up to about 4 passes repeated tokens are worth nearly as
    # much as fresh ones, beyond it their value falls quickly (Muennighoff et al. 2023)
    max_repeats: float = 4.0

    def validate(self, prefix: str = "data.") -> None:
        check_choices(self, prefix)
        if self.mixture:
            self._validate_mixture()
        try:
            self._validate_source()
        except ScalevecError as e:
            if prefix == "data.":
                raise
            raise ScalevecError(e.where.replace("data.", prefix, 1), e.problem, e.fix) from None
        self._validate_shared()

    def sources(self) -> list[tuple[MixtureSource, "DataConfig"]]:
        """Each mixture entry with the single-source config that prepares it."""
        shared = [f.name for f in fields(SourceOptions)]
        return [(m, replace(self, mixture=[], **{k: getattr(m, k) for k in shared}))
                for m in self.mixture]

    def _validate_mixture(self) -> None:
        if self.path or self.source != "stdlib":
            raise ScalevecError("data.mixture", f"is set, and so is data.source={self.source} "
                                f"data.path={self.path!r}, which a mixture ignores.",
                                "put every source in data.mixture (each entry has its own source "
                                "and path), and leave data.source and data.path at their defaults.")
        seen: set[str] = set()
        for i, m in enumerate(self.mixture):
            where = f"data.mixture[{i}]"
            if not _NAME.fullmatch(m.name):
                raise ScalevecError(f"{where}.name",
                                    f"{m.name!r} cannot name a metric (val_loss/<name>).",
                                    "use letters, digits, _ . or -, e.g. name: code.")
            if m.name in seen:
                raise ScalevecError(f"{where}.name", f"{m.name!r} names two sources.",
                                    "give each a name of its own.")
            seen.add(m.name)
            if not (math.isfinite(m.weight) and m.weight > 0):
                raise ScalevecError(f"{where}.weight", f"{m.weight} is not a positive number.",
                                    "give every source a weight > 0 (a source without samples has "
                                    "no place in the mixture).")
            if m.max_tokens < 0:
                raise ScalevecError(f"{where}.max_tokens", f"{m.max_tokens} is negative.",
                                    "use 0 for no cap.")
            if m.source == "shards" and not self.tokenizer_path:
                raise ScalevecError(f"{where}.source",
                                    "is shards, which come with a tokenizer of their own, "
                                    "but data.tokenizer_path is empty.",
                                    "set data.tokenizer_path to the shards' tokenizer: every "
                                    "source of a mixture uses it.")
        for i, (_, single) in enumerate(self.sources()):
            single.validate(prefix=f"data.mixture[{i}].")

    def _validate_source(self) -> None:
        if self.source in EMBEDDED and self.path:
            raise ScalevecError("data.path",
                                f"is set ({self.path!r}) but data.source={self.source} ignores it.",
                                "pick the source that reads it (data=text_dir, data=hf, "
                                "data=shards) or clear data.path.")
        if self.source not in EMBEDDED and not self.path:
            raise ScalevecError("data.path", f"data.source={self.source} needs a path.",
                                f"pass data.path=... ({_PATH_HELP[self.source]}).")
        if self.source == "text_dir" and not self.patterns:
            raise ScalevecError("data.patterns", "is empty, so no file can match.",
                                "list file-name patterns such as ['*.txt'].")
        if self.source == "hf" and not self.text_field:
            raise ScalevecError("data.text_field", "is empty.",
                                "name the column that holds the text.")
        if not 0.0 < self.val_fraction < 1.0:
            raise ScalevecError("data.val_fraction", f"{self.val_fraction} is outside (0, 1).",
                                "hold out a small share of documents, e.g. 0.02.")
        if self.max_corpus_bytes < 0:
            raise ScalevecError("data.max_corpus_bytes", f"{self.max_corpus_bytes} is negative.",
                                "use 0 for no limit.")

    def _validate_shared(self) -> None:
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
        if not self.max_repeats > 0:
            raise ScalevecError("data.max_repeats", f"{self.max_repeats} is not positive.",
                                "use the number of passes over the data to allow before warning, "
                                "e.g. 4.")


_PATH_HELP = {
    "text_dir": "a folder of text files",
    "hf": "a dataset name or a local jsonl/parquet/arrow file or folder",
    "shards": "a folder prepared earlier, holding its tokenizer, train/ and val/",
}
