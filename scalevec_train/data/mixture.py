"""A mixture's data (data.mixture): each source prepared as a single source would be (its own cache
entry, the same parallel workers), all with one tokenizer: data.tokenizer_path, or one trained here
on the sources' training text in proportion to their weights, cached under tokenizers/ like any
other."""

from dataclasses import dataclass
from pathlib import Path

from scalevec_train.data import tokenizer
from scalevec_train.data.config import DataConfig, MixtureSource
from scalevec_train.data.corpus import open_corpus
from scalevec_train.data.prepare import PreparedData, digest, exclusive, prepare_source_share
from scalevec_train.data.split import ValSplit


@dataclass(frozen=True)
class MixtureData:
    """The prepared sources of a mixture, in config order. The tokenizer attributes are the one all
    of them share, so that code written for one PreparedData (check_vocab, token_bytes) takes a
    mixture."""

    sources: list[tuple[MixtureSource, PreparedData]]

    @property
    def first(self) -> PreparedData:
        return self.sources[0][1]

    @property
    def tokenizer_path(self) -> Path:
        return self.first.tokenizer_path

    @property
    def tokenizer_hash(self) -> str:
        return self.first.tokenizer_hash

    @property
    def vocab_size(self) -> int:
        return self.first.vocab_size

    @property
    def eos_id(self) -> int:
        return self.first.eos_id

    def load_tokenizer(self) -> tokenizer.Tokenizer:
        return self.first.load_tokenizer()


def prepare_mixture_share(cfg: DataConfig, rank: int, world: int,
                          local_world: int = 1) -> MixtureData | None:
    """sources.prepare_share for a mixture: process `rank`'s share of every source in turn; None
    while another process still has parts of some source to write (the last process to finish each
    source merges it)."""
    cfg.validate()
    tok_path = (tokenizer.resolve(Path(cfg.tokenizer_path)) if cfg.tokenizer_path
                else _shared_tokenizer(cfg))
    prepared = []
    for entry, single in cfg.sources():
        # shards are checked against it (open_prepared), text is encoded with it
        single.tokenizer_path = str(tok_path)
        prepared.append((entry, prepare_source_share(single, rank, world, local_world)))
    if any(data is None for _, data in prepared):
        return None
    return MixtureData(prepared)


def _shared_tokenizer(cfg: DataConfig) -> Path:
    """The tokenizer trained on about data.tokenizer_train_bytes of the sources' training documents,
    weight_k / sum(weights) of them from source k (in its corpus order)."""
    total = sum(m.weight for m in cfg.mixture)
    sources = [(entry.weight / total, single, open_corpus(single))
               for entry, single in cfg.sources()]
    identity = {"mixture": [{"source": single.source, "corpus": corpus.fingerprint(),
                             "val_fraction": single.val_fraction, "share": share}
                            for share, single, corpus in sources],
                "tokenizer": tokenizer.settings(cfg.vocab_size, cfg.tokenizer_type,
                                                cfg.tokenizer_train_bytes)}
    path = Path(cfg.cache_dir) / "tokenizers" / f"mixture-{digest(identity)}.model"
    with exclusive(Path(cfg.cache_dir)):
        if not path.is_file():
            tokenizer.train(_training_lines(sources, cfg.tokenizer_train_bytes), cfg.vocab_size,
                            cfg.tokenizer_type, path)
    return path


def _training_lines(sources: list, budget: int):
    for share, single, corpus in sources:
        split = ValSplit(single.val_fraction, corpus.keys())
        texts = (doc.read() for doc in corpus.documents() if not split.is_val(doc.key))
        yield from tokenizer.training_lines(texts, max(1, round(share * budget)))
