"""The in-loop task numbers against lm-evaluation-harness itself: a tiny baseline model exported as
a plain Llama (scalevec_train.export), ARC-, HellaSwag-, PIQA- and generic jsonl-format items,
scored by scalevec and by the harness through its HFLM: the first three with the harness's own
arc_easy, hellaswag and piqa tasks (their prompts, preprocessing and metrics, only the data files
swapped for these), jsonl with a task written here (choices as written: target_delimiter ""). The
same log-likelihood of every choice, and the same acc and acc_norm item by item. Skipped where
lm-eval is not installed (`pip install -e ".[harness]"`, which make setup leaves out); there
tests/tasks/test_scoring.py checks the scorer against the harness's definitions written out."""

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from scalevec_train.data import tokenizer
from scalevec_train.interop.hf_export import export_model
from scalevec_train.model.transformer import Transformer
from scalevec_train.tasks.config import TaskConfig
from scalevec_train.tasks.formats import read_items
from scalevec_train.tasks.scoring import choice_logprobs, encode_task, task_metrics
from tests.support.helpers import make_config
from tests.support.presets import TINY_MODEL

lm_eval = pytest.importorskip("lm_eval",
                              reason="lm-eval is not installed (pip install -e '.[harness]')")
pytest.importorskip("transformers")
pytest.importorskip("accelerate",
                    reason="lm-eval's HFLM needs accelerate (pip install -e '.[harness]')")

# model.max_seq_len: the export's max_position_embeddings, where the harness cuts inputs
MAX_LEN = 48
ARC = [{"question": q, "choices": {"text": texts, "label": ["A", "B", "C", "D"][:len(texts)]},
        "answerKey": key}
       for q, texts, key in [
           ("Which is hot?", ["the sun", "ice", "snow, mostly", "déjà vu"], "A"),
           ("What does größer mean?", ["bigger", "smaller ≠ bigger", "green", "grün"], "A"),
           ("Which tool cuts wood?", ["a saw", "a cup", "a spoon", "a pillow"], "B"),
           ("Pick a letter.", ["a", "bc", "b", "def"], "A"),
           ("Where do fish live?", ["in water", "in trees", "on the moon", "in fire"], "A")]]
# the Hugging Face layout: label a string; markup at the end leaves the context a trailing space
HELLASWAG = [
    {"activity_label": "Baking cookies", "ctx_a": "A chef shows a stack of pans.",
     "ctx_b": "the pans",
     "endings": ["are filled with dough.", "[step] fly away.", "are blue.", "sing a song."],
     "label": "0"},
    {"activity_label": "Personal Care", "ctx_a": "[header] How to dye your hair [title]",
     "ctx_b": "",
     "endings": ["Buy the dye.", "[title] Wait a year.", "Eat it, ç'est bon.", "Sing."],
     "label": "2"},
    # > MAX_LEN
    {"activity_label": "Running",
     "ctx_a": " ".join(["The runner runs around the long track again."] * 6),
     "ctx_b": "she", "endings": ["stops.", "keeps running.", "flies.", "swims."], "label": "1"}]
PIQA = [{"goal": "How do I open a jar?", "sol1": "Twist the lid.",
         "sol2": "Twist the jar's label off.", "label": 0},
        {"goal": "dresser", "sol1": "replace drawer with bobby pin", "sol2": "finish, woodwork",
         "label": 1},
        {"goal": "Say hi.", "sol1": "🙂🙂🙂", "sol2": "hello there", "label": 0},
        {"goal": "Smile.", "sol1": "😀😀", "sol2": "a smile", "label": 1}]
JSONL = [  # a context that ends mid-word, one that ends in whitespace, an empty one
    {"context": "The ca", "choices": ["t sat on the mat.", "r goes.", "ke"], "label": 0},
    {"context": "for i in range(10):\n", "choices": ["    print(i)\n", "print\n"], "label": 1},
    {"context": "", "choices": ["def f():\n", "class A:\n"], "label": 1},
    {"context": "def add(a, b):\n    return", "choices": [" a + b", " None"], "label": 0}]
# the harness's own task configs (under lm_eval/tasks), or one written here for the generic layout
JSONL_TASK = {"output_type": "multiple_choice", "doc_to_text": "context",
              "doc_to_choice": "choices", "doc_to_target": "label", "target_delimiter": "",
              "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                              {"metric": "acc_norm", "aggregation": "mean",
                               "higher_is_better": True}]}
TASKS = {"arc": ("arc/arc_easy.yaml", ARC), "hellaswag": ("hellaswag/hellaswag.yaml", HELLASWAG),
         "piqa": ("piqa/piqa.yaml", PIQA), "jsonl": (JSONL_TASK, JSONL)}


def write_lines(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


def strings(rows) -> list[str]:
    if isinstance(rows, str):
        return [rows]
    values = rows.values() if isinstance(rows, dict) else rows
    return [s for v in values if not isinstance(v, int) for s in strings(v)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(model, tokenizer, export folder): a tokenizer trained on the items' words, a
    baseline model."""
    root = tmp_path_factory.mktemp("harness")
    text = (strings([rows for _, rows in TASKS.values()])
            + ["Question: x\nAnswer: y", "The cat sat on the mat."])
    tokenizer.train([line for line in "\n".join(text).split("\n") if line] * 3, 400, "bpe",
                    root / "tokenizer.model")
    tok = tokenizer.load(root / "tokenizer.model")
    cfg = make_config(*TINY_MODEL, f"model.vocab_size={tok.get_piece_size()}", "scale=baseline",
                      f"model.max_seq_len={MAX_LEN}", f"train.seq_len={MAX_LEN}")
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed=3)
    return model.eval(), tok, export_model(model, tok, root / "hf")


def harness_samples(export: Path, files: dict[str, Path], cache: Path) -> dict[str, list[dict]]:
    """The harness's per-item records of each task, by doc_id, its data read from `files`."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    specs = []
    for fmt, (config, _) in TASKS.items():
        spec = (dict(config) if isinstance(config, dict)
                else load_yaml(Path(lm_eval.tasks.__file__).parent / config, resolve_func=True))
        spec.pop("tag", None)
        spec.update(task=f"scalevec_{fmt}", dataset_path="json", dataset_name=None,
                    training_split=None, validation_split="validation", test_split=None,
                    dataset_kwargs={"data_files": {"validation": str(files[fmt])},
                                    "cache_dir": str(cache)})
        specs.append(spec)
    lm = HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=4)
    # no seeds: the harness leaves the process's random state alone
    out = lm_eval.simple_evaluate(model=lm, tasks=specs, num_fewshot=0, log_samples=True,
                                  bootstrap_iters=0,
                                  task_manager=TaskManager(include_defaults=False),
                                  random_seed=None, numpy_random_seed=None, torch_random_seed=None,
                                  fewshot_random_seed=None)
    return {fmt: sorted(out["samples"][f"scalevec_{fmt}"], key=lambda s: s["doc_id"])
            for fmt in TASKS}


def right_by(lls: list[float], lengths: list[int], label: int) -> bool:
    return max(range(len(lls)), key=lambda c: lls[c] / lengths[c]) == label


def test_acc_and_acc_norm_are_the_harness_item_by_item(exported, tmp_path):
    model, tok, export = exported
    files = {fmt: write_lines(tmp_path / f"{fmt}.jsonl", rows) for fmt, (_, rows) in TASKS.items()}
    harness = harness_samples(export, files, tmp_path / "datasets")
    # acc_norm item by item, were the lengths counted otherwise
    other_norms = {"bytes": [], "delimiter": []}
    for fmt, (_, rows) in TASKS.items():
        items = read_items(TaskConfig(name=fmt, format=fmt, path=str(files[fmt])), tmp_path)
        task = encode_task(fmt, items, tok, MAX_LEN)
        # its last item was cut
        assert fmt != "hellaswag" or max(len(r) for r in task.rows) == MAX_LEN + 1
        scores = choice_logprobs(model, task, torch.device("cpu"), nullcontext, batch_size=3)
        samples = harness[fmt]
        assert [s["doc_id"] for s in samples] == list(range(len(rows)))
        for i, (item, sample) in enumerate(zip(items, samples, strict=True)):
            lls = [r[0][0] for r in sample["resps"]]
            torch.testing.assert_close(scores[i, :len(lls)], torch.tensor(lls, dtype=torch.float64),
                                       rtol=0, atol=2e-4,
                                       msg=f"{fmt} item {i}: per-choice log-likelihoods")
            one = task_metrics(scores[i:i + 1, :len(lls)], encode_task(fmt, [item], tok, MAX_LEN))
            assert ((one["acc"].item(), one["acc_norm"].item())
                    == (sample["acc"], sample["acc_norm"])), (fmt, i)
            if item.delimiter:
                other_norms["bytes"].append(right_by(lls, [len(c.encode()) for c in item.choices],
                                                     item.label)
                                            != sample["acc_norm"])
                other_norms["delimiter"].append(right_by(lls, [len(" " + c) for c in item.choices],
                                                         item.label)
                                                != sample["acc_norm"])
        metrics = task_metrics(scores, task)
        for name in ("acc", "acc_norm"):
            assert (metrics[name].item()
                    == pytest.approx(sum(s[name] for s in samples) / len(samples)))
    # the items tell the harness's acc_norm from one per byte, and from one that counts the
    # delimiter ...
    assert any(other_norms["bytes"]) and any(other_norms["delimiter"])
    # ... and its split of the whole string from encoding context and choice apart
    assert tok.encode("The cat sat on the mat.")[:len(tok.encode("The ca"))] != tok.encode("The ca")
