"""What a corpus is: documents in a fixed order, and a cheap fingerprint of its content.

A document's key names it stably (a relative file path, a row number) and decides the validation split;
its size (bytes of text) is known without reading it, so that a process can step over the documents
another process encodes.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Document:
    key: str
    size: int  # bytes of text
    read: Callable[[], str]


class Corpus(Protocol):
    def keys(self) -> list[str] | None:
        """All document keys up front, or None where they are only known by reading (streaming)."""

    def fingerprint(self) -> object:
        """A JSON-able value that changes whenever the documents may have changed; cheap to compute."""

    def documents(self) -> Iterator[Document]:
        """The documents, always in the same order."""
