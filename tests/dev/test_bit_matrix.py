"""The bit-for-bit matrix (dev/bit_matrix.py), quick: one case recorded and checked against the
recording (the same 12 steps, and the run resumed from the recorded step-6 checkpoint, equal to the
last float), and the comparison naming a step that differs."""

import sys

from tests.support.helpers import REPO, load_script

CASE = "dense-unified-adamw-1rank"


def test_one_case_records_and_checks_identical(tmp_path, corpus_dir, monkeypatch, capsys):
    """The script's main() in this process (its training runs are its own subprocesses still), on
    the suite's small corpus instead of the standard library: preparing that (a tokenizer trained on
    all of it, every file encoded) would cost most of the test and is not what it checks."""
    matrix = load_script(REPO / "dev" / "bit_matrix.py")
    monkeypatch.setattr(matrix, "COMMON",
                        [*matrix.COMMON, "data=text_dir", f"data.path={corpus_dir}"])

    def main(*argv):
        monkeypatch.setattr(sys, "argv", ["bit_matrix.py", *map(str, argv)])
        code = matrix.main()
        return code, capsys.readouterr().out

    code, out = main("record", tmp_path, "--cases", CASE)
    assert code == 0, out
    assert out.splitlines()[-1] == "all 1 case(s) identical"  # the resumed run repeats the full one
    code, out = main("check", tmp_path, "--cases", CASE)
    assert code == 0, out
    assert out.splitlines() == [f"{CASE}: identical", "all 1 case(s) identical"]


def test_a_difference_is_named_by_step():
    matrix = load_script(REPO / "dev" / "bit_matrix.py")
    want = {"loss": [[7, 5.25], [8, 5.125]], "grad_norm": [[7, 1.5], [8, 1.25]],
            "val_loss": [[9, 5.0]]}
    got = {"loss": [[7, 5.25], [8, 5.125000000000001]], "grad_norm": [[7, 1.5], [8, 1.25]],
           "val_loss": []}
    assert matrix.differences("case", want, got) == [
        "case: step 8 loss 5.125000000000001, expected 5.125",
        "case: 0 values of val_loss, expected 1"]
