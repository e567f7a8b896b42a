"""Training recipes (configs/recipe/): every model trains with its own sequence length, batch,
learning rate, warm-up and length unless told otherwise; the micro-batch follows the ranks;
train.tokens_per_param sets the length. Expected numbers are closed forms of the model's shape, not
the code's own counts."""

import itertools
import json
import shlex
from pathlib import Path

import pytest
import yaml

from scalevec_train.config import CONFIG_DIR
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.train import run
from tests.support.helpers import REPO, make_config_at, make_config_shared
from tests.support.launch import Processes, train_command
from tests.support.presets import TINY_MODEL

MODELS = sorted(p.stem for p in (Path(CONFIG_DIR) / "model").glob("*.yaml"))


def closed_form_params(m) -> int:
    """Non-embedding weights a token multiplies with, from the shape: attention plus the SwiGLU
    (MoE: top_k routed experts, the shared experts and the router)."""
    head = m.dim // m.n_heads
    attention = 2 * m.dim * m.n_heads * head + 2 * m.dim * m.n_kv_heads * head
    if m.moe is None:
        ffn = 3 * m.dim * m.ffn_dim
    else:
        shared = m.moe.num_shared_experts * 3 * m.dim * (m.moe.shared_expert_dim or m.ffn_dim)
        ffn = m.moe.top_k * 3 * m.dim * m.moe.expert_dim + shared + m.dim * m.moe.num_experts
    return m.n_layers * (attention + ffn)


def recipe_file(name: str) -> dict:
    return yaml.safe_load((Path(CONFIG_DIR) / "recipe" / f"{name}.yaml").read_text()) or {}


def recipe_owner(name: str) -> str:
    """The model whose recipe `name`'s recipe is: itself, or the one its recipe extends."""
    parents = [d for d in recipe_file(name).get("defaults", []) if d != "_self_"]
    return recipe_owner(parents[0]) if parents else name


@pytest.mark.parametrize("model", MODELS)
def test_every_model_has_a_recipe_that_runs_on_1_to_8_ranks(model):
    assert (Path(CONFIG_DIR) / "recipe" / f"{model}.yaml").is_file()
    for ranks, cfg in make_config_at([f"model={model}"], (1, 2, 4, 8)).items():
        t = cfg.train
        accumulation = t.global_batch // (t.micro_batch * ranks)
        assert accumulation * t.micro_batch * ranks == t.global_batch
        assert t.micro_batch * t.seq_len <= t.max_micro_batch_tokens or t.micro_batch == 1
        assert cfg.schedule.warmup_steps < t.steps and t.seq_len <= cfg.model.max_seq_len


@pytest.mark.parametrize("model", [m for m in MODELS if recipe_file(recipe_owner(m)).get("train")])
def test_gpu_recipes_follow_their_rule(model):
    """Sequences of 2048 tokens, the batch in tokens, 20 tokens per non-embedding parameter of the
    recipe's model, warm-up over 10% of the steps (at most 2,000)."""
    owner = recipe_owner(model)
    own = recipe_file(owner)
    cfg = make_config_shared(f"model={model}")
    tokens = int(own["train"]["global_batch"].removeprefix("${batch_tokens:").removesuffix("}"))
    assert cfg.train.seq_len == 2048 and cfg.train.global_batch * 2048 == tokens
    assert cfg.train.steps == round(
        20 * closed_form_params(make_config_shared(f"model={owner}").model) / tokens)
    assert cfg.schedule.warmup_steps == min(round(0.1 * cfg.train.steps), 2000)
    assert cfg.optim.lr == own["optim"]["lr"]


def test_models_without_a_gpu_recipe_keep_the_defaults():
    tiny = make_config_shared("model=dense-tiny")
    for model in ("dense-study", "moe-study", "dense-l2", "moe-tiny"):
        cfg = make_config_shared(f"model={model}")
        assert (cfg.train, cfg.optim, cfg.schedule) == (tiny.train, tiny.optim, tiny.schedule)
    assert (tiny.train.steps, tiny.train.global_batch, tiny.train.micro_batch,
            tiny.train.seq_len) == (300, 16, 16, 128)


def test_explicit_values_win_over_the_recipe():
    base = make_config_shared("model=dense-1b")
    assert (base.train.seq_len, base.train.global_batch, base.optim.lr) == (2048, 256, 6e-4)
    # the recipe's batch is in tokens: a shorter sequence means more of them
    assert make_config_shared("model=dense-1b", "train.seq_len=1024").train.global_batch == 512
    cfg = make_config_shared("model=dense-1b", "train.global_batch=64", "optim.lr=1e-3",
                             "train.steps=10", "schedule.warmup_steps=2", "optim=muon")
    assert (cfg.train.global_batch, cfg.optim.lr, cfg.train.steps,
            cfg.schedule.warmup_steps) == (64, 1e-3, 10, 2)
    assert make_config_shared("model=dense-1b", "optim=muon").optim.lr == 6e-4
    other = make_config_shared("model=dense-1b", "recipe=dense-0.12b")
    assert (other.model.dim, other.optim.lr, other.train.steps) == (2048, 1.5e-3, 3510)
    # experiment presets come after the recipe: the study's pinned settings hold on any model
    study = make_config_shared("+experiment=study_base", "model=dense-1b")
    assert (study.train.seq_len, study.train.global_batch, study.train.steps,
            study.optim.lr) == (128, 16, 160, 3e-3)
    with pytest.raises(ScalevecError, match="train.global_batch: 524288 tokens are not a whole "
                                            "number of sequences"):
        make_config_shared("model=dense-1b", "train.seq_len=1000")


@pytest.mark.parametrize("global_batch,ranks,seq_len,cap,micro", [
    (16, 1, 128, 16384, 16), (16, 2, 128, 16384, 8), (16, 4, 128, 16384, 4), (16, 8, 128, 16384, 2),
    (256, 1, 2048, 16384, 8), (256, 8, 2048, 16384, 8), (24, 1, 128, 900, 6), (7, 1, 128, 16384, 7),
    (12, 1, 4096, 2048, 1), (96, 2, 1000, 10000, 8),
])
def test_micro_batch_is_the_largest_whole_share_within_the_cap(global_batch, ranks, seq_len, cap,
                                                               micro):
    cfg = make_config_shared(f"train.global_batch={global_batch}", f"train.seq_len={seq_len}",
                             "model.max_seq_len=4096", f"train.max_micro_batch_tokens={cap}",
                             f"train.eval_batches={ranks}", world_size=ranks)
    assert cfg.train.micro_batch == micro
    explicit = make_config_shared("train.micro_batch=4", world_size=2)
    assert explicit.train.micro_batch == 4


def test_tokens_per_param_sets_the_steps_from_the_non_embedding_parameters():
    dense = make_config_shared("model=dense-l2", "train.tokens_per_param=10")
    n = 13312 * 2**3  # the ladder rule: 13 * (32 L)^2 * L
    assert dense.train.steps == round(10 * n / (16 * 128)) == 520
    # scale vectors do not count: every strategy gets the same budget
    assert make_config_shared("model=dense-l2", "scale=unified",
                              "train.tokens_per_param=10").train.steps == 520
    moe = make_config_shared("model=moe-l2", "train.tokens_per_param=10")
    # plus the routers, 64 x 8 per layer
    assert moe.train.steps == round(10 * (n + 64 * 8 * 2) / (16 * 128))
    # it replaces train.steps, a recipe's included
    recipe = make_config_shared("model=dense-0.12b", "train.tokens_per_param=5")
    assert recipe.train.steps == round(5 * 92_012_544 / 524288)
    # checkpoints at fixed budgets: every 2.5 tokens per parameter, without tokens_per_param too
    assert make_config_shared("model=dense-l2",
                              "checkpoint.every_tokens_per_param=2.5").checkpoint.every == 130
    with pytest.raises(ScalevecError, match="train.tokens_per_param: must be positive"):
        make_config_shared("train.tokens_per_param=0")


DOCUMENTED = ["README.md",
              *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs" / "guides").glob("*.md"))]


def documented_train_overrides() -> list[tuple[str, list[str], tuple[int, ...]]]:
    """The overrides of every training command in the code blocks of README.md and the guides
    (docs/guides/), one list per sweep point, each with the file it is in and the world sizes it
    must compose at: the one its torchrun line names (nnodes x nproc_per_node), else 1 and 8 (a
    plain command, or a launcher script taking the size elsewhere)."""
    commands = []
    for name in DOCUMENTED:
        lines = []
        for line in (REPO / name).read_text().splitlines():
            if lines and lines[-1].endswith("\\"):  # a command continued on the next line
                lines[-1] = lines[-1][:-1] + line.strip()
            else:
                lines.append(line)
        for line in lines:
            if not line.startswith("    ") or not any(k in line for k in ("scalevec_train.train",
                                                                          "launch_multinode.sh",
                                                                          "slurm.sbatch")):
                continue
            words = shlex.split(line.split(" #")[0])
            start = next(i for i, w in enumerate(words)
                         if w.endswith(("scalevec_train.train", ".sh", ".sbatch"))) + 1
            launcher = dict(w.removeprefix("--").split("=", 1) for w in words[:start]
                            if w.startswith("--") and "=" in w)
            sizes = ((int(launcher.get("nnodes", 1)) * int(launcher["nproc_per_node"]),)
                     if "nproc_per_node" in launcher else (1, 8))
            # Hydra's own settings (a launcher) are not the run's config; tests/run/test_sweeps.py
            # runs them. "..." (more overrides of the reader's) and `key=...` (a value the reader
            # fills in) are left out.
            args = [w for w in words[start:] if w != "-m" and not w.startswith(("hydra/", "hydra."))
                    and w != "..." and not w.endswith("=...")]
            # a sweep's comma-separated values, not the commas of a list or dict value
            axes = [[f"{w.split('=', 1)[0]}={v}" for v in w.split("=", 1)[1].split(",")]
                    if "," in w and not w.split("=", 1)[1].startswith(("[", "{")) else [w]
                    for w in args]
            commands.extend((name, list(point), sizes) for point in itertools.product(*axes))
    return commands


def test_every_documented_training_command_composes_at_its_world_size():
    """Every training command in README.md and the guides runs as written: each composes at the
    world size its torchrun line names (an expert-parallel command needs its ranks), else at 1 and 8
    ranks."""
    commands = documented_train_overrides()
    overrides = [c for _, c, _ in commands]
    assert ["model=dense-1b"] in overrides and len(commands) >= 8
    assert any("train.tokens_per_param=50" in c and any(w.startswith("branch_from=") for w in c)
               for c in overrides)
    assert ("docs/guides/scaling-out.md", ["model=moe-2b", "distributed.expert_parallel=8"],
            (8,)) in commands
    # the guides that hold training commands are all read
    assert {"docs/guides/training.md", "docs/guides/experiments.md", "docs/guides/scaling-out.md",
            "docs/guides/data.md", "docs/guides/interop.md"} <= {name for name, _, _ in commands}
    for _, command, sizes in commands:
        make_config_at(command, sizes)


def train_launched(processes: Processes | None, nproc: int, run_dir: Path,
                   overrides: list[str]) -> dict[int, float]:
    """Train with `nproc` processes (torchrun above 1; one process: in this one, `run` of the config
    the command composes, which needs no process of its own) and no batch override; returns the
    losses. One validation batch (at steps 0 and 3), not 8: the batch split is what this checks, and
    16 validation forwards cost more than the 3 steps. dense-tiny's recipe (its batch and sequence
    length) on a model of TINY_MODEL's shape: the split follows the batch and the ranks, not the
    model's width."""
    overrides = [*overrides, "model=dense-tiny", *TINY_MODEL, "train.steps=3",
                 "schedule.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
                 "train.eval_batches=1", f"run_dir={run_dir}"]
    if nproc == 1:
        run(make_config_shared(*overrides))
    else:
        processes.run(train_command(nproc, *overrides), run_dir.parent)
    assert (yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["micro_batch"]
            == 16 // nproc)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens"] for r in records if "loss" in r] == [16 * 128 * s for s in (1, 2, 3)]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def one_process_losses(data_overrides, tmp_path_factory) -> dict[int, float]:
    return train_launched(None, 1, tmp_path_factory.mktemp("ranks1") / "run", data_overrides)


def test_torchrun_derives_the_micro_batch_without_batch_overrides(tmp_path, data_overrides,
                                                                  one_process_losses, processes):
    """`torchrun --nproc_per_node=4 -m scalevec_train.train model=dense-tiny` with no batch
    override: each rank takes 16 / 4 sequences per step, and the losses are the single process's.
    One launch, at 4 ranks: the micro-batch is derived by one code path for any number of ranks
    (checked at 1, 2, 4 and 8 by test_micro_batch_is_the_largest_whole_share_within_the_cap), and 4
    ranks split the batch further than 2 would."""
    losses = train_launched(processes, 4, tmp_path / "run", data_overrides)
    assert losses == pytest.approx(one_process_losses, rel=1e-5)
