"""Downstream multiple-choice tasks: read from local files or generated from the corpus's held-out
documents (formats.py, next_line.py), scored by the log-likelihood of each choice (scoring.py)."""
