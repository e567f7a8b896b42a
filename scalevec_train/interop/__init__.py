"""Interoperability: load() of a trained run in one process (api.py), export to a Hugging Face
transformers folder (export.py, with the remote-code model hf_modeling/), and import of a Hugging
Face Llama to continue pre-training (hf_import.py)."""
