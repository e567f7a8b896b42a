"""Part of the stand-in for Hugging Face `datasets` (see __init__.py)."""

from . import _absent as split_dataset_by_node  # noqa: F401
