"""Tasks as configured: HellaSwag-, ARC- and PIQA-format files (a few items written here) read
through tasks.items into the items lm-evaluation-harness would score, and scored; the generic
layout; bad files and configs named; the task the embedded corpus brings generated deterministically
from held-out documents, with the stated number of choices and the true line among them."""

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from scalevec_train.data import prepare_data
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.transformer import Transformer
from scalevec_train.tasks import next_line
from scalevec_train.tasks.formats import Item
from scalevec_train.tasks.load import load_tasks, task_items
from scalevec_train.tasks.scoring import score
from tests.support.helpers import make_config
from tests.support.presets import TINY_MODEL

HELLASWAG = [  # the release's layout (label an int); the Hugging Face one has it as a string
    {"ind": 4, "activity_label": "Removing ice from car",
     "ctx_a": "Then, the man writes over the snow covering "
     "the window of a car, and a woman wearing winter clothes smiles.", "ctx_b": "then",
     "endings": [", the man adds wax to the windshield and cuts it.",
                 ", a person board a ski lift.", ", the man puts on a christmas coat.",
                 ", the man continues removing the snow on his car."],
     "label": 3, "split": "val"},
    {"ind": 9, "activity_label": "Baking cookies", "ctx_a": "A female chef in white uniform shows "
     "a stack of baking pans in a large kitchen presenting them.", "ctx_b": "the pans",
     "endings": ["contain egg yolks and baking soda.", "are then sprinkled with brown sugar.",
                 "are placed in a strainer on the counter.",
                 "are filled with pastries and loaded into the oven."],
     "label": "3", "split": "val"},
    {"ind": 12, "activity_label": "Personal Care and Style",
     "ctx_a": "[header] How to dye your hair [title] "
     "Buy the dye.", "ctx_b": "",
     "endings": ["[step] Mix it well.", "Wait a year.", "Eat it.", "Sing."], "label": 0,
     "split": "val"},
]
ARC = [  # the Hugging Face layout, then the original release's
    {"id": "Mercury_7175875", "question": "An astronomer observes that a planet rotates faster "
     "after a meteorite impact. Which is the most likely effect of this increase in rotation?",
     "choices": {"text": ["Planetary density will decrease.", "Planetary years will become longer.",
                          "Planetary days will become shorter.",
                          "Planetary gravity will become stronger."],
                 "label": ["A", "B", "C", "D"]}, "answerKey": "C"},
    {"id": "MCAS_2000_4_6", "question": {"stem": "Which technology was developed most recently?",
                                         "choices": [{"text": "cellular telephone", "label": "1"},
                                                     {"text": "television", "label": "2"},
                                                     {"text": "refrigerator", "label": "3"}]},
     "answerKey": "1"},
]
PIQA = [{"goal": "How do I ready a guinea pig cage for it's new occupants?",
         "sol1": "Provide the guinea pig with a cage full of a few inches of bedding made of "
         "ripped paper strips.",
         "sol2": "Provide the guinea pig with a cage full of a few inches of bedding made of "
         "ripped jeans material."},
        {"goal": "dresser", "sol1": "replace drawer with bobby pin", "sol2": "finish, woodwork"}]


def write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def configured(tmp_path: Path, *items: str, data: tuple[str, ...] = ()):
    return make_config(*data, f"tasks.items=[{','.join(items)}]", f"tasks.dir={tmp_path}")


def test_hellaswag_and_arc_files_score_through_the_configured_loader(tmp_path, data_overrides):
    write_lines(tmp_path / "hs.jsonl", HELLASWAG)
    write_lines(tmp_path / "arc.jsonl", ARC)
    cfg = configured(tmp_path, "{name:hs,format:hellaswag,path:hs.jsonl}",
                     "{name:arc,format:arc,path:arc.jsonl}",
                     "{name:arc2,format:arc,path:arc.jsonl,limit:1}",
                     data=(*data_overrides, *TINY_MODEL))
    hs, arc, _ = [task_items(t, Path(cfg.tasks.dir), cfg.data) for t in cfg.tasks.items]
    assert hs[0] == Item("Removing ice from car: Then, the man writes over the snow covering the "
                         "window of a car, and a woman wearing winter clothes smiles. Then",
                         tuple(HELLASWAG[0]["endings"]), 3, " ")
    assert hs[1].label == 3
    # WikiHow markup: " [title]" ends a sentence, other brackets go, double spaces close up
    assert hs[2].context == "Personal Care and Style: How to dye your hair. Buy the dye."
    assert hs[2].choices[0] == " Mix it well."  # as lm-evaluation-harness: the markup's space stays
    assert arc == [Item(f"Question: {ARC[0]['question']}\nAnswer:",
                        tuple(ARC[0]["choices"]["text"]), 2, " "),
                   Item("Question: Which technology was developed most recently?\nAnswer:",
                        ("cellular telephone", "television", "refrigerator"), 0, " ")]
    data = prepare_data(cfg.data)
    tasks = load_tasks(cfg.tasks, cfg.data, data.load_tokenizer(), cfg.model.max_seq_len)
    assert ([(t.name, t.labels.tolist(), t.width) for t in tasks]
            == [("hs", [3, 3, 0], 4), ("arc", [2, 0], 4), ("arc2", [2], 4)])
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed=0)
    for task in tasks:
        metrics = score(model, task, torch.device("cpu"), nullcontext, batch_size=4)
        assert 0 <= metrics["acc"].item() <= 1 and metrics["bpb"].item() > 0
    assert tasks[1].chance == pytest.approx((1 / 4 + 1 / 3) / 2)


def test_piqa_labels_from_a_field_or_a_separate_file(tmp_path):
    write_lines(tmp_path / "piqa.jsonl", PIQA)
    (tmp_path / "piqa-labels.lst").write_text("0\n1\n")
    write_lines(tmp_path / "piqa_hf.jsonl", [{**row, "label": 1 - i} for i, row in enumerate(PIQA)])
    cfg = configured(tmp_path, "{name:p,format:piqa,path:piqa.jsonl,labels:piqa-labels.lst}",
                     "{name:q,format:piqa,path:piqa_hf.jsonl}")
    separate, field = [task_items(t, Path(cfg.tasks.dir), cfg.data) for t in cfg.tasks.items]
    assert separate[1] == Item("Question: dresser\nAnswer:",
                               ("replace drawer with bobby pin", "finish, woodwork"), 1, " ")
    assert [i.label for i in separate] == [0, 1] and [i.label for i in field] == [1, 0]


def test_generic_layout_and_bad_files(tmp_path):
    write_lines(tmp_path / "g.jsonl", [{"context": "1 + 1 =", "choices": [" 2", " 3"], "label": 0}])
    cfg = configured(tmp_path, "{name:g,format:jsonl,path:g.jsonl}")
    assert task_items(cfg.tasks.items[0], tmp_path, cfg.data) == [Item("1 + 1 =", (" 2", " 3"), 0)]
    write_lines(tmp_path / "bad.jsonl", [{"context": "x", "choices": [" a", " b"], "label": 2}])
    with pytest.raises(ScalevecError, match="bad.jsonl:1: label 2"):
        task_items(configured(tmp_path, "{name:b,format:jsonl,path:bad.jsonl}").tasks.items[0],
                   tmp_path, cfg.data)
    with pytest.raises(ScalevecError, match="is not a hellaswag item"):
        task_items(configured(tmp_path, "{name:b,format:hellaswag,path:g.jsonl}").tasks.items[0],
                   tmp_path, cfg.data)
    with pytest.raises(ScalevecError, match="missing.jsonl does not exist"):
        task_items(configured(tmp_path, "{name:m,format:arc,path:missing.jsonl}").tasks.items[0],
                   tmp_path, cfg.data)


@pytest.mark.parametrize("items,key", [("{name:a,format:arc}", "tasks.items[0].path"),
                                       ("{name:a,format:next_line,path:x}", "tasks.items[0].path"),
                                       ("{name:a/b,format:next_line}", "tasks.items[0].name"),
                                       ("{name:a,format:mmlu,path:x}", "tasks.items[0].format"),
                                       ("{name:a,format:next_line,num_choices:1}",
                                        "tasks.items[0].num_choices")])
def test_bad_task_configs_are_named(items, key):
    with pytest.raises(ScalevecError, match=key.replace("[", r"\[").replace("]", r"\]")):
        make_config(f"tasks.items=[{items}]")


def source(name: str, n: int) -> str:
    """A module of n functions whose body lines use several names."""
    out = []
    for f in range(n):
        out.append(f"def {name}_{f}(value_{f}, other):\n"
                   "    \"\"\"Docstring line that is long enough.\n"
                   f"    and its second line, also long enough\"\"\"\n"
                   + "".join(f"    result_{f}_{k} = value_{f} * {k} + other.{name}\n"
                             for k in range(6))
                   + "    # a comment line that is long enough\n"
                   + f"    return result_{f}_0 + helper_{name}(value_{f})\n\n")
    return "".join(out)


def test_swaps_trade_two_different_names():
    assert (next_line.swaps("    x = f(y)")
            == sorted(["    f = x(y)", "    y = f(x)", "    x = y(f)"]))
    # keywords stay; equal names trade nothing
    assert next_line.swaps("    return a if a else None") == []


def test_next_line_items_are_deterministic_with_the_true_line_among_k():
    docs = [(f"mod{d}.py", source(f"mod{d}", 8)) for d in range(5)]
    items = next_line.generate(docs, 40, 4)
    assert len(items) == 40 and items == next_line.generate(docs, 40, 4)
    three = next_line.generate(docs, 40, 3)
    assert three != items and all(len(i.choices) == 3 for i in three)
    labels = set()
    for item in items:
        assert len(item.choices) == 4 and len(set(item.choices)) == 4
        true = item.choices[item.label]
        labels.add(item.label)
        # the true line continues its function
        assert any(item.context + true in t for _, t in docs)
        assert (item.context.startswith("def ")
                and len(item.context.splitlines()) <= next_line.MAX_CONTEXT_LINES)
        for c in item.choices:  # the same characters: no length or formatting cue
            assert sorted(c) == sorted(true) and c.endswith("\n")
            assert c == true or c.rstrip("\n") in next_line.swaps(true.rstrip("\n"))
            # docstrings and comments are not code lines
            assert "Docstring" not in c and "#" not in c
    assert labels == {0, 1, 2, 3}


def test_next_line_reads_the_held_out_documents(tmp_path):
    for d in range(10):
        (tmp_path / f"mod{d}.py").write_text(source(f"mod{d}", 4))
    cfg = make_config("data=text_dir", f"data.path={tmp_path}", "data.val_fraction=0.3")
    held_out = next_line.held_out_documents(cfg.data)
    assert len(held_out) == 3  # round(0.3 * 10)
    items = next_line.generate(held_out, 0, 4)
    assert items and all(any(i.context in t for _, t in held_out) for i in items)
    with pytest.raises(ScalevecError, match="next_line reads held-out files"):
        next_line.held_out_documents(make_config("data=shards", "data.path=/x").data)


def test_the_embedded_corpus_brings_the_task():
    """tasks=embedded on the default corpus (the standard library's held-out files): 500 items of 4
    choices, the same every time they are generated."""
    cfg = make_config("tasks=embedded")
    (task,) = cfg.tasks.items
    items = task_items(task, Path(cfg.tasks.dir), cfg.data)
    assert (len(items) == task.limit == 500
            and {len(i.choices) for i in items} == {task.num_choices} == {4})
    assert items == task_items(task, Path(cfg.tasks.dir), cfg.data)
