"""The task the embedded corpus brings (format next_line): which line comes next in a Python function.

Generated deterministically from the held-out (validation) documents of the run's corpus, which the model
never trains on. An item's context is a function from its `def` line down to a line of its body (at most
MAX_CONTEXT_LINES lines); its choices are that body line and num_choices - 1 lines from other held-out
documents, in a random order (chance: 1 / num_choices). Every line scored is a code line of a function's
body: indented, not blank, not a comment, not inside a docstring, MIN_CHARS to MAX_CHARS characters
without its indentation. So that formatting and length give nothing away, the other lines have exactly
the true line's indentation and about its length (LENGTH_RATIO), and none of them occurs in the true
line's document. A choice is the whole line with its newline.
"""

import bisect
import random

from scalevec_train.data.config import DataConfig
from scalevec_train.data.corpus import FileCorpus, open_corpus
from scalevec_train.data.split import ValSplit
from scalevec_train.errors import ScalevecError
from scalevec_train.tasks.formats import Item

MAX_CONTEXT_LINES = 12
MIN_CHARS, MAX_CHARS = 12, 72
LENGTH_RATIO = 1.25  # the other lines are at most this much longer or shorter than the true one
SEED = "scalevec next_line"  # which targets are sampled; each item draws from its own seed (its place)


def held_out_documents(data: DataConfig) -> list[tuple[str, str]]:
    """(key, text) of the corpus's validation documents, in corpus order: the documents preparation holds
    out (data/split.py), for the file sources (stdlib, python_env, text_dir)."""
    if data.source not in ("stdlib", "python_env", "text_dir"):
        raise ScalevecError("tasks.items", f"format next_line reads held-out files; data.source={data.source} "
                            "has none.", "train on stdlib, python_env or text_dir, or drop the next_line task.")
    corpus = open_corpus(data)
    assert isinstance(corpus, FileCorpus)
    split = ValSplit(data.val_fraction, corpus.keys())
    return [(doc.key, doc.read()) for doc in corpus.documents() if split.is_val(doc.key)]


def generate(documents: list[tuple[str, str]], limit: int, num_choices: int) -> list[Item]:
    """`limit` items (0: every eligible line) from (key, text) documents; the same for the same input."""
    lines = {key: text.split("\n") for key, text in documents}
    eligible = {key: _body_lines(ls) for key, ls in lines.items()}
    pool: dict[str, list[tuple[int, str, str]]] = {}  # indentation -> (length, text, key), sorted
    seen = set()
    for key, found in eligible.items():
        for i, _ in found:
            text = lines[key][i]
            if text not in seen:
                seen.add(text)
                indent = text[:len(text) - len(text.lstrip())]
                pool.setdefault(indent, []).append((len(text.strip()), text, key))
    for entries in pool.values():
        entries.sort()
    targets = [(key, i, start) for key, found in eligible.items() for i, start in found if start is not None]
    order = list(range(len(targets)))
    random.Random(SEED).shuffle(order)
    picked = []  # (place in corpus order, item): a random sample, listed in corpus order
    for n in order:
        key, i, start = targets[n]
        item = _item(lines[key], i, start, key, pool, num_choices)
        if item is not None:
            picked.append((n, item))
            if len(picked) == limit:
                break
    items = [item for _, item in sorted(picked, key=lambda p: p[0])]
    if not items:
        raise ScalevecError("tasks.items", "the held-out documents hold no function body lines to ask about.",
                            "use a corpus of Python source (data.source=stdlib), or drop the next_line task.")
    return items


def _item(lines: list[str], i: int, start: int, key: str, pool: dict, num_choices: int) -> Item | None:
    true = lines[i]
    indent = true[:len(true) - len(true.lstrip())]
    length = len(true.strip())
    entries = pool[indent]
    lo = bisect.bisect_left(entries, (int(length / LENGTH_RATIO + 0.999),))
    hi = bisect.bisect_right(entries, (int(length * LENGTH_RATIO), chr(0x10FFFF)))
    own = set(lines)
    others = [text for _, text, k in entries[lo:hi] if k != key and text not in own]
    if len(others) < num_choices - 1:
        return None
    rng = random.Random(f"{SEED}:{key}:{i}")
    choices = rng.sample(others, num_choices - 1)
    label = rng.randrange(num_choices)
    choices.insert(label, true)
    context = "".join(line + "\n" for line in lines[start:i])
    return Item(context, tuple(c + "\n" for c in choices), label)


def _body_lines(lines: list[str]) -> list[tuple[int, int | None]]:
    """(index, index of the enclosing `def` line within MAX_CONTEXT_LINES above, or None) of every line
    that may be scored: a code line of a function body (see the module docstring)."""
    found = []
    in_docstring = False
    defs: list[tuple[int, int]] = []  # (indentation, line index) of the enclosing defs, innermost last
    for i, line in enumerate(lines):
        stripped = line.strip()
        quotes = line.count('"""') + line.count("'''")
        if in_docstring or quotes:
            in_docstring = in_docstring != (quotes % 2 == 1)
            continue
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while defs and indent <= defs[-1][0]:
            defs.pop()
        if stripped.startswith(("def ", "async def ")):
            defs.append((indent, i))
            continue
        if not defs or stripped.startswith("#") or not MIN_CHARS <= len(stripped) <= MAX_CHARS:
            continue
        start = defs[-1][1]
        found.append((i, start if i - start <= MAX_CONTEXT_LINES else None))
    return found
