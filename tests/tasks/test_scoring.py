"""The multiple-choice scorer against lm-evaluation-harness's definitions written out here (each
request through the model on its own, log-softmax, the continuation's log-probabilities summed;
acc_norm on hand-set log-likelihoods), on 1 process and on 2 gloo ranks under FSDP2 (the same
scores); and a run that scores tasks trains exactly as the same run without them.
tests/tasks/test_harness.py runs the harness itself where it is installed."""

import json
import math
from contextlib import nullcontext
from functools import partial

import pytest
import torch
from torch._dynamo.utils import counters

from scalevec_train import evaluate as evaluate_cli
from scalevec_train.data import tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.model.transformer import Transformer
from scalevec_train.parallel.data_parallel import parallelize
from scalevec_train.tasks.formats import Item
from scalevec_train.tasks.scoring import choice_logprobs, encode_task, score, task_metrics
from scalevec_train.train import run
from tests.support.helpers import SHORT_RUN, make_config
from tests.support.launch import gloo_group, records, spawn
from tests.support.presets import TINY_MODEL, TINY_MOE

MAX_LEN = 24
# 10 items of 2 to 4 choices: choices joined by a delimiter or written with their space, contexts
# that end in whitespace (it moves to the continuation) or inside a word, an empty context,
# non-ASCII choices; the 8th context is longer than MAX_LEN tokens, so it loses its beginning
ITEMS = [
    Item("def add(a, b):\n    return", (" a + b", " a - b", " None"), 0),
    Item("The cat sat on the ", ("mat.", "moon, said the dog loudly.", "roof", "größer ≠"), 2),
    Item("for i in range(10):\n", ("    print(i)\n", "print\n"), 1),
    Item("import os\n", ("import sys\n", "x = 1\n", "    pass\n"), 0),
    Item("Question: what is 2 + 2?\nAnswer:", ("4", "four", "22", "fish"), 1, " "),
    Item("class A:\n", ("    pass\n", "    def f(self):\n"), 0),
    Item("", ("def f():\n", "class A:\n"), 1),
    Item("x = 1\n" * 20, ("y = 2\n", "x = 1\n", "return x\n"), 1),
    Item("Question: is größer ≠ groß?\nAnswer:", ("Ja, größer.", "no"), 0, " "),
    Item("The ca", ("t sat on the mat.", "r goes.", "ke"), 0),
]
TEXT = "".join(item.context + item.delimiter + "".join(item.choices) for item in ITEMS) * 3


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> tokenizer.Tokenizer:
    out = tmp_path_factory.mktemp("sp") / "tokenizer.model"
    tokenizer.train([line for line in (TEXT + "plain words and more words\n" * 20).split("\n")
                     if line], 400, "bpe", out)
    return tokenizer.load(out)


def tiny_model(vocab: int, *extra: str) -> Transformer:
    cfg = make_config(*TINY_MODEL, f"model.vocab_size={vocab}", "scale=unified", *extra)
    model = Transformer(cfg.model, cfg.scale)
    model.init_weights(seed=5)
    return model


def harness_tokens(tok: tokenizer.Tokenizer, context: str,
                   continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness 0.4's (context tokens, continuation tokens) for a causal model
    (TemplateLM.loglikelihood and _encode_pair): an empty context is EOS (the prefix token of a
    tokenizer without BOS); trailing whitespace of the context moves to the continuation; context
    and context + continuation are encoded whole, the continuation is the second past the
    first's length."""
    if not context:
        return [tok.eos_id()], tok.encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = tok.encode(context)
    return context_ids, tok.encode(context + continuation)[len(context_ids):]


def harness_loglikelihood(model: torch.nn.Module, tok: tokenizer.Tokenizer, context: str,
                          continuation: str) -> float:
    """HFLM._loglikelihood_tokens on one request: (context + continuation)[-(max_length + 1):][:-1]
    through the model, log-softmax, the continuation tokens' log-probabilities summed."""
    context_ids, ids = harness_tokens(tok, context, continuation)
    seq = torch.tensor((context_ids + ids)[-(MAX_LEN + 1):])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq[None, :-1])[0].double(), -1)[-len(ids):]
    return logp.gather(1, seq[-len(ids):, None]).sum().item()


def test_scores_are_the_harness_loglikelihoods(tok):
    model = tiny_model(tok.get_piece_size())
    model.train()
    task = encode_task("t", ITEMS, tok, MAX_LEN)
    assert max(len(r) for r in task.rows) == MAX_LEN + 1  # the long item was cut to fit
    # the items tell splitting the whole string from encoding context and choice apart
    assert tok.encode("The cat sat on the mat.")[:len(tok.encode("The ca"))] != tok.encode("The ca")
    scores = choice_logprobs(model, task, torch.device("cpu"), nullcontext, batch_size=3)
    assert model.training  # left in the mode it was found in
    want = [[harness_loglikelihood(model, tok, item.context, item.delimiter + c)
             for c in item.choices]
            for item in ITEMS]
    for i, item in enumerate(ITEMS):
        torch.testing.assert_close(scores[i, :len(item.choices)],
                                   torch.tensor(want[i], dtype=torch.float64), rtol=1e-5, atol=1e-5)
        assert torch.isinf(scores[i, len(item.choices):]).all()
    metrics = score(model, task, torch.device("cpu"), nullcontext, batch_size=2)
    # the harness's process_results: argmax of the log-likelihoods, and of them over len(choice)
    acc = sum(max(range(len(w)), key=w.__getitem__) == item.label
              for w, item in zip(want, ITEMS)) / len(ITEMS)
    acc_norm = sum(max(range(len(w)), key=lambda c: w[c] / len(item.choices[c])) == item.label
                   for w, item in zip(want, ITEMS)) / len(ITEMS)
    # bits per byte of the right continuations: the context's moved whitespace, the delimiter,
    # the choice
    right = [item.context[len(item.context.rstrip()):] + item.delimiter + item.choices[item.label]
             for item in ITEMS]
    bpb = (-sum(w[item.label] for w, item in zip(want, ITEMS)) / math.log(2)
           / sum(len(r.encode()) for r in right))
    assert metrics["acc"].item() == pytest.approx(acc)
    assert metrics["acc_norm"].item() == pytest.approx(acc_norm)
    assert metrics["bpb"].item() == pytest.approx(bpb, rel=1e-6)
    assert (metrics["chance"]
            == pytest.approx(sum(1 / len(item.choices) for item in ITEMS) / len(ITEMS)))


def test_acc_norm_divides_by_the_choice_characters(tok):
    """Hand-set log-likelihoods where the harness's acc_norm (per character of the choice, the
    delimiter not counted; the first of equal scores) picks the right choice of all three items, and
    dividing by bytes (item 0), or by characters with the delimiter (item 1), would not; acc picks
    none of them but the tie (item 2)."""
    items = [Item("Q:", ("aaaa", "éé"), 0, " "), Item("Q:", ("a", "bbbbbbbbb"), 1, " "),
             Item("Q:", ("ab", "cd"), 0, " ")]
    task = encode_task("t", items, tok, MAX_LEN)
    lls = torch.tensor([[-4.4, -2.4], [-1.0, -5.5], [-3.0, -3.0]], dtype=torch.float64)
    # per character: -1.1 > -1.2; -1.0 < -0.61; a tie. Per byte: -1.1 < -0.6. With the
    # delimiter: -0.5 > -0.55
    metrics = task_metrics(lls, task)
    assert metrics["acc_norm"].item() == 1.0
    assert metrics["acc"].item() == pytest.approx(1 / 3)


def test_unscorable_items_are_named(tok):
    with pytest.raises(ScalevecError, match="choice 1: the choice is [0-9]+ tokens; the model "
                       "reads at most 4 "):
        encode_task("t", [Item("x", ("a", "a b c d e f g h i j"), 0)], tok, 4)
    with pytest.raises(ScalevecError, match="item 0's choice 0: its context has no tokens"):
        encode_task("t", [Item("  \n", ("a", "b"), 0)], tok, MAX_LEN)


def _rank(rank: int, world: int, store: str, out: str, model_file: str, tok_file: str) -> None:
    with gloo_group(store, rank, world):
        tok = tokenizer.load(tok_file)
        cfg = make_config(*TINY_MODEL, f"model.vocab_size={tok.get_piece_size()}", "scale=unified",
                          world_size=world)
        with torch.device("meta"):
            model = Transformer(cfg.model, cfg.scale)
        model = parallelize(model, cfg.distributed, torch.device("cpu"), seed=0, dtype="fp32")
        state = torch.load(model_file)
        for name, p in model.named_parameters():  # each rank keeps its shard of the saved weights
            p.data.copy_(torch.distributed.tensor.distribute_tensor(state[name], p.device_mesh,
                                                                    p.placements)
                         if hasattr(p, "device_mesh") else state[name])
        task = encode_task("t", ITEMS, tok, MAX_LEN)
        scores = choice_logprobs(model, task, torch.device("cpu"), nullcontext, 2, rank, world)
        torch.save(scores, f"{out}/rank{rank}.pt")


def test_two_ranks_give_the_scores_of_one(tok, tmp_path):
    """10 items over 2 ranks in batches of 2 rows: rank 0 scores 5 items (13 rows), rank 1 5 (15
    rows), so rank 0 runs a forward of no item while rank 1 finishes."""
    model = tiny_model(tok.get_piece_size())
    torch.save(model.state_dict(), tmp_path / "model.pt")
    tok_file = tmp_path / "tokenizer.model"
    tok_file.write_bytes(tok.serialized_model_proto())
    one = choice_logprobs(model, encode_task("t", ITEMS, tok, MAX_LEN), torch.device("cpu"),
                          nullcontext, 2)
    spawn(_rank,
          (2, str(tmp_path / "store"), str(tmp_path), str(tmp_path / "model.pt"), str(tok_file)))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(1), one.argmax(1))


RUN = [*SHORT_RUN, "train.steps=4", "train.log_every=2", *TINY_MOE, "model.ffn_dim=128",
       "model.moe.expert_dim=32"]
NUMBERS = ("step", "loss", "grad_norm", "val_loss", "val_bpb")


def task_overrides(tmp_path) -> list[str]:
    """ITEMS as a JSONL task file, scored every 2 steps."""
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps({"context": i.context, "choices": list(i.choices),
                                        "label": i.label}) + "\n"
                            for i in ITEMS))
    return [f"tasks.items=[{{name:toy,format:jsonl,path:{path}}}]", "tasks.every=2"]


def test_scoring_tasks_leaves_training_unchanged(tmp_path, data_overrides, capsys):
    """A MoE run (its routers' bias moves with every training forward) scores a task at steps 0, 2
    and 4: its losses, gradient norms and validation numbers are bit for bit those of the run
    without tasks. `evaluate tasks=run` on its final checkpoint scores what the trainer scored at
    the last step."""
    scored = run(make_config(*data_overrides, *RUN, *task_overrides(tmp_path),
                             f"run_dir={tmp_path / 'tasks'}"))
    plain = run(make_config(*data_overrides, *RUN, f"run_dir={tmp_path / 'plain'}"))
    with_tasks = records(scored)
    assert [r["step"] for r in with_tasks if "task/toy/acc" in r] == [0, 2, 4]
    assert all(0 <= r["task/toy/acc"] <= 1 and r["task/toy/bpb"] > 0
               for r in with_tasks if "task/toy/acc" in r)
    assert [{k: r[k] for k in NUMBERS if k in r} for r in with_tasks] == \
        [{k: r[k] for k in NUMBERS if k in r} for r in records(plain)]
    capsys.readouterr()  # the runs' own output
    assert evaluate_cli.main([str(scored), "tasks=run"]) == 0
    printed = dict(line.split() for line in capsys.readouterr().out.splitlines())
    last = with_tasks[-1]
    for metric in ("acc", "acc_norm", "bpb", "chance"):
        assert (float(printed[f"task/toy/{metric}"])
                == pytest.approx(last[f"task/toy/{metric}"], abs=1e-6))
    assert float(printed["val_loss"]) == pytest.approx(last["val_loss"], rel=1e-6)
    assert float(printed["val_bpb"]) == pytest.approx(last["val_bpb"], rel=1e-5)
    assert evaluate_cli.main([str(scored), "tasks=nonesuch"]) == 2
    assert "tasks: 'nonesuch' is no preset" in capsys.readouterr().err


def test_scoring_under_compile_compiles_nothing(tmp_path, data_overrides, monkeypatch):
    """Under distributed.compile the items' shapes (other batch sizes and lengths than training's)
    stay out of the compiled blocks, so training keeps its graphs for static shapes: a run scoring a
    task every 2 steps compiles exactly as many graphs as the run without. Dynamo's eager backend:
    the same guards, recompiles and dynamic-shape decisions as inductor, without generating code. 2
    steps: tasks scored at step 0, before training compiles anything, and at step 2, after its
    graphs exist (a third scoring at step 4 met the same graphs again)."""
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    graphs = {}
    for name, extra in (("plain", []), ("tasks", task_overrides(tmp_path))):
        torch._dynamo.reset()
        counters.clear()
        run(make_config(*data_overrides, *RUN, "train.steps=2", "distributed.compile=true", *extra,
                        f"run_dir={tmp_path / name}"))
        graphs[name] = counters["stats"]["unique_graphs"]
    assert graphs["tasks"] == graphs["plain"] > 0
