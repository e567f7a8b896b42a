"""Bad input (configs, data, checkpoints), through the command line and in-process: each fails with
its own message before expensive work, and leaves every run directory byte-identical."""

import hashlib
import io
import json
import os
import pickle
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from scalevec_train.checkpoint import files as checkpoint_files
from scalevec_train.data import prepare_data
from scalevec_train.data import tokenizer as sp_tokenizer
from scalevec_train.infra.errors import ScalevecError
from scalevec_train.infra.faults import FAULT_AT_ENV
from scalevec_train.train import run
from tests.support.helpers import make_config
from tests.support.launch import child_env, train_command, train_in_process
from tests.support.presets import SMALL_MODEL

RUN = [*SMALL_MODEL, "model.ffn_dim=128", "train.seq_len=32", "train.global_batch=4",
       "train.eval_batches=2", "train.eval_every=0", "schedule.warmup_steps=2", "train.steps=40",
       "train.log_every=1", "checkpoint.every=3"]


@pytest.fixture(scope="module")
def common(data_overrides) -> list[str]:
    return [*data_overrides, *RUN]


def tree_digest(root: Path) -> dict[str, str]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def existing(common, tmp_path_factory) -> Path:
    """A finished one-process run with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("bad_input") / "existing"
    run(make_config(*common, "train.micro_batch=2", "train.steps=4", "checkpoint.every=2",
                    f"run_dir={run_dir}"))
    assert ([p.name for p in checkpoint_files.complete_checkpoints(run_dir)]
            == ["step_000002", "step_000004"])
    return run_dir


@pytest.fixture(scope="module")
def prepared(common) -> Path:
    return prepare_data(make_config(*common, "train.micro_batch=2").data).root


@dataclass
class Ctx:
    tmp: Path
    existing: Path
    prepared: Path
    guarded: list[Path] = field(default_factory=list)  # directories that must stay byte-identical

    def copy_run(self) -> Path:
        dst = self.tmp / "run_copy"
        shutil.copytree(self.existing, dst)
        self.guarded.append(dst)
        return dst

    def checkpoint(self) -> Path:
        return checkpoint_files.complete_checkpoints(self.copy_run())[-1]

    def shards(self) -> Path:
        dst = self.tmp / "shards"
        shutil.copytree(self.prepared, dst)
        return dst


def truncate(path: Path, keep: int | None = None) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2 if keep is None else keep])


def foreign_tokens(shards: Path) -> None:
    """Same size as the shard it replaces, but not tokens of this vocabulary."""
    shard = shards / "train" / "00000.bin"
    shard.write_bytes(b"\xff" * shard.stat().st_size)


def other_tokenizer(ctx: Ctx) -> Path:
    out = ctx.tmp / "other.model"
    lines = [f"line {i} of another corpus with words {i * 7} and {i * 13}" for i in range(400)]
    sp_tokenizer.train(lines, 300, "bpe", out)
    return out


def corrupt_metadata(ckpt: Path) -> None:
    (ckpt / ".metadata").write_bytes(b"not a pickle")


class CallOnLoad:
    """Pickles to a function call: a crafted .metadata must be refused, not executed."""

    def __reduce__(self):
        return (os.getcwd, ())


def code_in_metadata(ckpt: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(CallOnLoad()))


def with_file(ctx: Ctx) -> Path:
    (ctx.tmp / "a_file").write_text("")
    return ctx.tmp / "a_file"


def incomplete_dir(ctx: Ctx) -> Path:
    ckpt = ctx.checkpoint()
    (ckpt / checkpoint_files.COMPLETE).unlink()
    return ckpt


def existing_run(*overrides: str):
    return lambda ctx: [f"run_dir={ctx.existing}", "resume=auto", *overrides]


def on_copy(damage, *overrides: str):
    """The existing run copied, one file of its newest checkpoint damaged, resumed with resume=auto
    and `overrides`."""
    def setup(ctx: Ctx) -> list[str]:
        ckpt = ctx.checkpoint()
        damage(ckpt)
        return [f"run_dir={ckpt.parent.parent}", "resume=auto", *overrides]
    return setup


# The checks behind the checksums, for a checkpoint read without them (trusted, or written before
# them).
UNVERIFIED = "checkpoint.verify=false"


def shards_with(ctx: Ctx, damage) -> Path:
    shards = ctx.shards()
    damage(shards)
    return shards


def bad_manifest(shards: Path) -> None:
    path = shards / "val" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["num_tokens"] += 1
    path.write_text(json.dumps(manifest))


def truncate_shard(shards: Path) -> None:
    truncate(shards / "train" / "00000.bin")


def empty_dir(ctx: Ctx) -> Path:
    (ctx.tmp / "empty").mkdir()
    return ctx.tmp / "empty"


@dataclass
class Case:
    name: str
    # config: fails while the config is composed; before_data: data preparation must not start;
    # before_model: the model must not be initialized
    stage: str
    # ctx -> overrides, applied after run_dir=<a fresh folder that must stay absent>
    setup: object
    message: str  # a part of the one-line message
    env: dict = field(default_factory=dict)


IN_PROCESS = [
    Case("heads", "config", existing_run("model.dim=100", "model.n_heads=3"),
         "model.dim: hidden size 100"),
    Case("seq_len", "config", existing_run("train.seq_len=2048"), "train.seq_len: 2048 is longer"),
    Case("optimizer", "config", existing_run("optim.name=sgd"), "optim.name"),
    Case("warmup", "config", existing_run("schedule.warmup_steps=500"), "schedule.warmup_steps"),
    Case("max_bad_steps", "config", existing_run("train.max_bad_steps=0"),
         "train.max_bad_steps: must be"),
    Case("run_dir_file", "before_data", lambda ctx: [f"run_dir={with_file(ctx)}"],
         "is a file, so it cannot"),
    Case("resume_none", "before_data", existing_run("resume=none"), "already holds checkpoints"),
    Case("resume_missing", "before_data", lambda ctx: [f"resume={ctx.tmp / 'nowhere'}"],
         "does not exist"),
    Case("resume_run_dir", "before_data", lambda ctx: [f"resume={ctx.existing}"],
         "is a run directory"),
    Case("resume_incomplete", "before_data", lambda ctx: [f"resume={incomplete_dir(ctx)}"],
         "is not a complete checkpoint"),
    Case("other_scale", "before_data", existing_run("scale=unified"),
         "scale.heterogeneity: 'shared' there, 'per_branch' here"),
    Case("truncated_checkpoint", "before_data", on_copy(lambda c: truncate(c / "__0_0.distcp")),
         "__0_0.distcp: is truncated"),
    Case("corrupt_metadata", "before_data", on_copy(corrupt_metadata, UNVERIFIED),
         ".metadata: cannot be read"),
    Case("code_in_metadata", "before_data", on_copy(code_in_metadata, UNVERIFIED),
         "unexpected object posix.getcwd"),
    Case("corrupt_train_state", "before_data",
         on_copy(lambda c: truncate(c / "train_state.json", 10), UNVERIFIED),
         "train_state.json: cannot be read"),
    Case("other_seq_len", "before_data", existing_run("train.seq_len=16"),
         "train.seq_len: 32 there, 16 here"),
    Case("foreign_shard", "before_model",
         lambda ctx: ["data=shards", f"data.path={shards_with(ctx, foreign_tokens)}"],
         "00000.bin: holds token id 65535"),
    Case("manifest", "before_model",
         lambda ctx: ["data=shards", f"data.path={shards_with(ctx, bad_manifest)}"],
         "manifest.json: says num_tokens="),
    Case("tokenizer", "before_model", lambda ctx: ["data=shards", f"data.path={ctx.shards()}",
                                                   f"data.tokenizer_path={other_tokenizer(ctx)}"],
         "was written with tokenizer"),
    Case("vocab", "before_model",
         lambda ctx: ["data=shards", f"data.path={ctx.shards()}", "model.vocab_size=256"],
         "model.vocab_size: 256 is smaller"),
    Case("data_path", "before_model", lambda ctx: ["data.path=/nonexistent/corpus"],
         "/nonexistent/corpus is not a folder"),
    Case("empty_corpus", "before_model", lambda ctx: [f"data.path={empty_dir(ctx)}"],
         "empty corpus"),
    Case("fault_env", "before_data", lambda ctx: [], f"{FAULT_AT_ENV}: 'x' is not",
         env={FAULT_AT_ENV: "x"}),
]
MESSAGES: dict[str, str] = {}


def fail(what: str):
    def boom(*args, **kwargs):
        raise AssertionError(f"{what} started before the bad input was reported")
    return boom


@pytest.mark.parametrize("case", IN_PROCESS, ids=lambda c: c.name)
def test_bad_input_fails_early_with_its_own_message(case, common, existing, prepared, tmp_path,
                                                    monkeypatch):
    ctx = Ctx(tmp_path, existing, prepared, guarded=[existing])
    overrides = case.setup(ctx)
    before = {d: tree_digest(d) for d in ctx.guarded}
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    if case.stage == "before_data":
        monkeypatch.setattr("scalevec_train.run.build.prepare_data", fail("data preparation"))
    monkeypatch.setattr("scalevec_train.run.build.parallelize", fail("model initialization"))
    with pytest.raises(ScalevecError) as info:
        run(make_config(*common, "train.micro_batch=2", f"run_dir={tmp_path / 'fresh'}",
                        *overrides))
    message = str(info.value)
    assert case.message in message, message
    assert " Fix: " in message and "\n" not in message
    for d in ctx.guarded:
        assert tree_digest(d) == before[d], d
    assert not (tmp_path / "fresh").exists()
    MESSAGES[case.name] = message


@dataclass
class CliCase:
    name: str
    args: object  # ctx -> overrides
    code: int
    message: str
    env: dict = field(default_factory=dict)


CLI = [
    CliCase("malformed_override", lambda ctx: ["train.steps"], 1,
            "Error parsing override 'train.steps'"),
    CliCase("unknown_preset", lambda ctx: ["model=dense-huge"], 1,
            "Could not find 'model/dense-huge'"),
    CliCase("unknown_key", lambda ctx: ["+train.warmup=5"], 2, "error: train.warmup: unknown key"),
    CliCase("wrong_type", lambda ctx: ["train.steps=many"], 2, "error: train.steps: Value 'many'"),
    CliCase("two_lengths", lambda ctx: ["train.tokens_per_param=10", "train.steps=22"], 2,
            "error: train.steps: 22 is given, but train.tokens_per_param=10 sets the "
            "run's length."),
    CliCase("world_size", lambda ctx: [], 2,
            "error: train.global_batch: 4 sequences are not divisible by micro_batch * "
            "ranks = 2 * 3", env={"WORLD_SIZE": "3"}),
    CliCase("unwritable_run_dir", lambda ctx: [f"run_dir={with_file(ctx) / 'run'}"], 2,
            "would be a folder under the file"),
    CliCase("other_model", lambda ctx: ["model.dim=96"], 2, "model.dim: 64 there, 96 here"),
    CliCase("kernels_on_cpu", lambda ctx: ["model.kernels=triton", "device=cpu"], 2,
            "error: model.kernels: kernels backend 'triton' needs CUDA tensors, got cpu."),
    CliCase("truncated_shard",
            lambda ctx: ["data=shards", f"data.path={shards_with(ctx, truncate_shard)}",
                         f"run_dir={ctx.tmp / 'fresh'}"], 2, "00000.bin: is truncated"),
]


def test_bad_input_on_the_command_line_exits_nonzero_with_one_message(
        common, existing, prepared, processes, tmp_path, capfd, monkeypatch):
    """Every case through the command's argument parsing and exit codes in this process; one of them
    also as a process of its own, which must exit and print the same (nothing else on its way
    out)."""
    before = tree_digest(existing)
    ctxs = {case.name: Ctx(tmp_path / case.name, existing, prepared) for case in CLI}
    args = {}
    for case in CLI:
        ctxs[case.name].tmp.mkdir()
        args[case.name] = [*common, "train.micro_batch=2", f"run_dir={existing}", "resume=auto",
                           *case.args(ctxs[case.name])]
    real = CLI[-1]  # the one that gets furthest (data preparation) before it fails
    started = processes.start(train_command(1, *args[real.name]), ctxs[real.name].tmp,
                              child_env(**real.env))
    for case in CLI:
        ctx = ctxs[case.name]
        code, out = train_in_process(args[case.name], case.env, ctx.tmp, capfd, monkeypatch)
        assert code == case.code, (case.name, out[-3000:])
        assert case.message in out, (case.name, out[-3000:])
        assert "Traceback" not in out, case.name
        if case.code == 2:
            assert len(out.strip().splitlines()) == 1 and " Fix: " in out, (case.name, out)
        assert not (ctx.tmp / "fresh").exists()
        MESSAGES[f"cli:{case.name}"] = out.strip()
    assert started.wait() == real.code, started.describe()
    # stdout and stderr, nothing but the error
    assert started.output().strip() == MESSAGES[f"cli:{real.name}"]
    assert tree_digest(existing) == before


def test_the_error_line_reaches_stderr_in_one_write(common, tmp_path, capfd, monkeypatch):
    """The ranks of a launch share one log: each rank's error line must be one write, or another
    rank's can land between a line and its end (seen under load in tests/training/test_faults.py,
    where stderr is unbuffered)."""
    writes = []

    class Recorded(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return super().write(text)

    monkeypatch.setattr(sys, "stderr", Recorded())
    code, _ = train_in_process([*common, "optim.lr=-1", f"run_dir={tmp_path / 'run'}"], {},
                               tmp_path, capfd, monkeypatch)
    assert code == 2
    (line,) = [w for w in writes if "error:" in w]
    assert line.startswith("error: optim.lr") and " Fix: " in line
    assert line.endswith("\n") and line.count("\n") == 1


def test_every_bad_input_has_its_own_message():
    """Runs after the cases above (file order); at least 20 distinct failures, none sharing a
    message."""
    if len(MESSAGES) < len(IN_PROCESS) + len(CLI):
        pytest.skip("needs the bad-input tests of this file to run first")
    assert len(MESSAGES) >= 20
    assert len(set(MESSAGES.values())) == len(MESSAGES)
