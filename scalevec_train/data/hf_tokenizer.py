"""A Hugging Face `tokenizers` tokenizer (a tokenizer.json) with the interface scalevec uses of a
SentencePiece processor: encode (no special tokens added), decode, eos_id, get_piece_size.

`tokenizers` is imported only when such a tokenizer is loaded.
"""

import json
import re
from pathlib import Path

import numpy as np

from scalevec_train.infra.errors import ScalevecError

# Names under which tokenizers carry their end-of-document token (Llama-2, T5: </s>; GPT-2, Qwen:
# <|endoftext|>; Llama-3: <|end_of_text|>; Gemma: <eos>).
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


class HfTokenizer:
    """`backend` is the tokenizers.Tokenizer. As in SentencePiece, special tokens written in text
    are text: a document that quotes "</s>" does not end there."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ScalevecError("data.tokenizer_path",
                                f"{path} needs the `tokenizers` package, which is not "
                                "installed.", "pip install 'scalevec[hf]'.") from None
        try:
            self.backend = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise ScalevecError(str(path), f"is not a Hugging Face tokenizer.json: {err}",
                                "point data.tokenizer_path at a tokenizer.json or a SentencePiece "
                                ".model file.") from None
        self.backend.encode_special_tokens = True
        vocab = self.backend.get_vocab(with_added_tokens=True)
        # ids need not be dense (added tokens may leave gaps): a model needs a row for the highest
        # one
        self._size = max(vocab.values()) + 1
        names = sorted(t.content for t in self.backend.get_added_tokens_decoder().values()
                       if t.special and t.content in EOS_NAMES)
        if not names:
            raise ScalevecError(str(path),
                                f"has none of the special tokens {list(EOS_NAMES)}, so the token "
                                "that ends a document is not known.",
                                "add one as a special token (tokenizers: "
                                "Tokenizer.add_special_tokens) and save the tokenizer.json again.")
        if len(names) > 1:
            raise ScalevecError(str(path),
                                f"has several special tokens that may end a document ({names}).",
                                "keep one of them special and save the tokenizer.json again.")
        self._eos = vocab[names[0]]

    def encode(self, input: str | list[str]) -> list[int] | list[list[int]]:
        if isinstance(input, str):
            return self.backend.encode(input, add_special_tokens=False).ids
        # one text at a time, on this thread: preparation runs a worker process per core instead
        return [self.backend.encode(text, add_special_tokens=False).ids for text in input]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes of text each id stands for (data.tokenizer.token_bytes): 0 for special
        tokens and unused ids; under a ByteLevel decoder each character of a token is one byte;
        otherwise "▁" is a space (Metaspace) and <0xNN> one byte (byte fallback)."""
        byte_level = _has_decoder(json.loads(self.backend.to_str()).get("decoder"), "ByteLevel")
        special = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        added = {t.content for t in self.backend.get_added_tokens_decoder().values()}
        sizes = np.zeros(self._size, dtype=np.int64)
        for piece, i in self.backend.get_vocab(with_added_tokens=True).items():
            if piece in special:
                continue
            if byte_level and piece not in added:
                sizes[i] = len(piece)
            elif _BYTE_PIECE.fullmatch(piece):
                sizes[i] = 1
            else:
                sizes[i] = len(piece.replace("\u2581", " ").encode())
        return sizes

    def eos_id(self) -> int:
        return self._eos

    def get_piece_size(self) -> int:
        return self._size


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _has_decoder(decoder: dict | None, kind: str) -> bool:
    """Whether a tokenizer.json decoder (or one of a Sequence's) is of type `kind`."""
    if not decoder:
        return False
    return decoder.get("type") == kind or any(_has_decoder(d, kind)
                                              for d in decoder.get("decoders", []))
