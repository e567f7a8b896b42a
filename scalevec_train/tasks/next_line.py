"""The task the embedded corpus brings (format next_line): which is the true next line of a Python
function.

Generated deterministically from the held-out (validation) documents of the run's corpus, which the
model never trains on. An item's context is a function from its `def` line down to a line of its
body (at most MAX_CONTEXT_LINES lines below the def); its choices are that next line and
num_choices - 1 versions of it in which two different names (identifiers, not keywords) trade
places, in a random order: chance is 1 / num_choices. `x = other.y(z)` may become `z = other.y(x)`
or `x = y.other(z)`: every choice has the same characters, bytes and indentation, so neither length
nor formatting tells them apart; the model has to know which name goes where, from the context and
from how code is written. Scored lines are code lines of a function's body: indented, not blank, not
a comment, not inside a docstring, MIN_CHARS to MAX_CHARS characters without their indentation, with
enough names for num_choices - 1 distinct swaps. A choice is the whole line with its newline.

(Choices drawn from other held-out files, of the same indentation and length, were tried first: a
dense-tiny trained by `make demo` scored 0.23 on them, chance 0.25 (docs/guides/experiments.md).)
"""

import keyword
import random
import re

from scalevec_train.data.config import DataConfig
from scalevec_train.data.corpus import FileCorpus, open_corpus
from scalevec_train.data.split import ValSplit
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.tasks.formats import Item

MAX_CONTEXT_LINES = 12
MIN_CHARS, MAX_CHARS = 12, 72
# which lines are sampled; each item draws its swaps from its own seed (its place)
SEED = "scalevec next_line"
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def held_out_documents(data: DataConfig) -> list[tuple[str, str]]:
    """(key, text) of the corpus's validation documents, in corpus order: the documents preparation
    holds out (data/split.py), for the file sources (stdlib, python_env, text_dir)."""
    if data.source not in ("stdlib", "python_env", "text_dir"):
        raise ScalevecError("tasks.items", "format next_line reads held-out files; "
                            f"data.source={data.source} has none.",
                            "train on stdlib, python_env or text_dir, or drop the next_line task.")
    corpus = open_corpus(data)
    assert isinstance(corpus, FileCorpus)
    split = ValSplit(data.val_fraction, corpus.keys())
    return [(doc.key, doc.read()) for doc in corpus.documents() if split.is_val(doc.key)]


def generate(documents: list[tuple[str, str]], limit: int, num_choices: int) -> list[Item]:
    """`limit` items (0: every eligible line) from (key, text) documents, in corpus order; the same
    for the same input."""
    lines = {key: text.split("\n") for key, text in documents}
    targets = [(key, i, start) for key, ls in lines.items() for i, start in _body_lines(ls)]
    order = list(range(len(targets)))
    random.Random(SEED).shuffle(order)
    picked = []  # (place in corpus order, item): a random sample
    for n in order:
        key, i, start = targets[n]
        item = _item(lines[key], i, start, random.Random(f"{SEED}:{key}:{i}"), num_choices)
        if item is not None:
            picked.append((n, item))
            if len(picked) == limit:
                break
    if not picked:
        raise ScalevecError("tasks.items", "the held-out documents hold no function body lines to "
                            "ask about.",
                            "use a corpus of Python source (data.source=stdlib), or drop the "
                            "next_line task.")
    return [item for _, item in sorted(picked, key=lambda p: p[0])]


def swaps(line: str) -> list[str]:
    """Every distinct line made from `line` by trading the places of two different names, sorted."""
    spans = [m.span() for m in _NAME.finditer(line) if not keyword.iskeyword(m.group())]
    out = set()
    for a, (a0, a1) in enumerate(spans):
        for b0, b1 in spans[a + 1:]:
            if line[a0:a1] != line[b0:b1]:
                out.add(line[:a0] + line[b0:b1] + line[a1:b0] + line[a0:a1] + line[b1:])
    out.discard(line)
    return sorted(out)


def _item(lines: list[str], i: int, start: int, rng: random.Random,
          num_choices: int) -> Item | None:
    others = swaps(lines[i])
    if len(others) < num_choices - 1:
        return None
    choices = rng.sample(others, num_choices - 1)
    label = rng.randrange(num_choices)
    choices.insert(label, lines[i])
    return Item("".join(line + "\n" for line in lines[start:i]), tuple(c + "\n" for c in choices),
                label)


def _body_lines(lines: list[str]) -> list[tuple[int, int]]:
    """(index, index of its enclosing `def` line) of every line that may be scored: a code line of a
    function body within MAX_CONTEXT_LINES of its def (see the module docstring)."""
    found = []
    in_docstring = False
    # (indentation, line index) of the enclosing defs, innermost last
    defs: list[tuple[int, int]] = []
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
        if defs and not stripped.startswith("#") and MIN_CHARS <= len(stripped) <= MAX_CHARS \
                and i - defs[-1][1] <= MAX_CONTEXT_LINES:
            found.append((i, defs[-1][1]))
    return found
