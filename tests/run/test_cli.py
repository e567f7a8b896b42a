"""The command line every command but train shares (run/cli.py): positional arguments, then
key=value pairs, a command's own options told apart from config overrides; a bad argument exits 2
with one error line naming it and the fix, then the usage."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from scalevec_train import average, coord_check, describe, evaluate, export, prepare_data, verify
from scalevec_train.run import cli


@dataclass
class Options:
    path: str = cli.positional("a run directory")
    out: str = cli.option("where the result goes")
    last: int | None = cli.option("the newest N checkpoints", None)
    steps: list[int] | None = cli.option("these steps", None)
    widths: tuple[int, ...] = cli.option("the widths", (1, 2))
    bound: float = cli.option("the largest slope", 0.25)
    verify: bool = cli.option("check the checksums first", True)


def error_lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_values_take_their_declared_types():
    o, rest = cli.parse(["runs/a", "out=x", "last=3", "steps=[200,300,400]", "widths=1,2,4",
                         "bound=0.5", "verify=false"], Options)
    assert o == Options("runs/a", "x", 3, [200, 300, 400], (1, 2, 4), 0.5, False) and rest == []
    assert cli.parse(["runs/a", "out=x"], Options)[0] == Options("runs/a", "x", None, None, (1, 2),
                                                                 0.25, True)
    # the last counts
    assert cli.parse(["runs/a", "out=x", "last=2", "last=3"], Options)[0].last == 3


def test_own_options_and_config_overrides_are_told_apart():
    """A key the command declares is its own (coord_check's seed, not the config's); any other, with
    Hydra's +key= and ~key, is an override, in order."""
    argv = ["seed=3", "model=dense-tiny", "model.dim=16", "+x.y=1", "~model.moe", "widths=1,4",
            "optim.lr=0.01"]
    o, rest = cli.parse(argv, coord_check.Options, overrides=True)
    assert (o.seed, o.widths, o.depths) == (3, (1, 4), (1, 2, 4, 8))
    assert rest == ["model=dense-tiny", "model.dim=16", "+x.y=1", "~model.moe", "optim.lr=0.01"]
    with pytest.raises(cli.UsageError, match=r"^model: is no option of this command. Fix: use one "
                                             r"of its options: out, last, steps, widths, "
                                             r"bound, verify.$"):
        cli.parse(["runs/a", "out=x", "model=dense-tiny"], Options)


@pytest.mark.parametrize("argv,message", [
    (["runs/a", "out=x", "nonesuch=1"],
     "nonesuch: is no option of this command. Fix: use one of its options: "),
    (["runs/a", "out=x", "=1"], "=1: has no key before its '='. Fix: give key=value."),
    (["runs/a", "runs/b", "out=x"],
     "runs/b: is one positional argument too many. Fix: give only <path>."),
    (["out=x"], "<path>: is missing. Fix: give a run directory."),
    (["runs/a"], "out: is missing. Fix: give out=<where the result goes>."),
    (["runs/a", "out=x", "last=three"],
     "last: 'three' is not a whole number. Fix: give last=<a whole number>."),
    (["runs/a", "out=x", "verify=no"],
     "verify: 'no' is not true or false. Fix: give verify=<true or false>."),
    (["runs/a", "out=x", "widths=1,x"], "widths: 'x' is not a whole number."),
    (["runs/a", "out=x", "--verify"],
     "--verify: options are key=value, not flags. Fix: use verify=<value>."),
    (["runs/a", "out=x", "-v"],
     "-v: is no option of this command (options are key=value, not flags)."),
])
def test_a_bad_argument_is_named_with_its_fix(argv, message):
    with pytest.raises(cli.UsageError) as info:
        cli.parse(argv, Options)
    assert str(info.value).startswith(message) and "\n" not in str(info.value), str(info.value)


def test_a_bad_argument_exits_2_with_one_error_line_then_the_usage(capsys):
    assert export.main(["runs/a", "out=x", "nonesuch=1"]) == 2
    lines = error_lines(capsys)
    assert (lines[0] == "error: nonesuch: is no option of this command. Fix: use one of its "
            "options: out, verify.")
    assert lines[1] == "usage: python -m scalevec_train.export <path> out=... [verify=true]"
    assert [line.split()[0] for line in lines[2:]] == ["path", "out", "verify"]
    # the options' own checks are reported the same way
    assert average.main(["runs/a", "out=x"]) == 2
    lines = error_lines(capsys)
    assert (lines[0].startswith("error: last/steps/ema: say which checkpoints to read")
            and lines[1].startswith("usage:"))


def test_evaluate_refuses_the_old_tasks_flag_naming_the_new_form(capsys):
    assert evaluate.main(["runs/a", "--tasks", "embedded"]) == 2
    err = capsys.readouterr().err
    assert (err.splitlines()[0] == "error: --tasks: options are key=value, not flags. Fix: use "
            "tasks=embedded.")
    assert "Traceback" not in err
    assert evaluate.main(["runs/a", "--tasks=standard"]) == 2
    assert error_lines(capsys)[0].endswith("Fix: use tasks=standard.")


def test_a_bad_config_override_is_one_error_line(capsys):
    assert describe.main(["model=dense-tiny", "nonesuch.key=1"]) == 2
    lines = error_lines(capsys)
    assert lines[0].startswith("error: config overrides: Could not override 'nonesuch.key'. Fix: ")
    assert lines[1].startswith("usage: python -m scalevec_train.describe [format=table] "
                               "[world_size=8] [device_gb=80]")
    assert describe.main(["model=dense-huge"]) == 2
    assert "Could not find 'model/dense-huge'." in error_lines(capsys)[0]


def test_help_prints_the_usage_and_every_option(capsys):
    assert coord_check.main(["--help"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("usage: python -m scalevec_train.coord_check [widths=1,2,4,8,16] "
                             "[depths=1,2,4,8]")
    assert [line.split()[0] for line in out[1:]] == ["widths", "depths", "steps", "grow", "bound",
                                                    "out", "seed", "batch", "seq", "overrides"]


def test_the_documented_command_lines_parse_as_written():
    """README.md's and docs/'s command lines of each command, with what each means."""
    assert cli.parse(["runs/my_run", "last=3", "out=runs/my_run-avg3"], average.Options)[0] == \
        average.Options("runs/my_run", "runs/my_run-avg3", last=3)
    assert (cli.parse(["runs/l8", "steps=[200,300,400]", "out=o"], average.Options)[0].steps
            == [200, 300, 400])
    assert (cli.parse(["runs/my_run", "ema=last", "out=runs/my_run-ema"], average.Options)[0].ema
            == "last")
    assert cli.parse(["runs/my_run", "out=exports/my_model"], export.Options)[0] == \
        export.Options("runs/my_run", "exports/my_model", verify=True)
    assert cli.parse(["runs/my-run"], verify.Options)[0] == verify.Options(Path("runs/my-run"))
    assert cli.parse(["runs/my_run", "tasks=embedded"], evaluate.Options)[0] == \
        evaluate.Options("runs/my_run", "embedded", verify=True)
    assert cli.parse(["model=dense-2b", "optim=muon", "world_size=1", "device_gb=80"],
                     describe.Options, overrides=True) == (describe.Options("table", 1, 80.0),
                                                           ["model=dense-2b", "optim=muon"])
    assert cli.parse(["model=dense-0.12b", "scale=unified", "format=json"], describe.Options,
                     overrides=True) == (describe.Options("json"),
                                         ["model=dense-0.12b", "scale=unified"])
    data = ["data=hf", "data.path=/shared/corpus", "data.cache_dir=/shared/data_cache"]
    assert cli.parse(data, prepare_data.Options, overrides=True) == (prepare_data.Options(), data)
