"""The bit-for-bit matrix (scripts/bit_matrix.py), quick: one case recorded and checked against the
recording (the same 12 steps, and the run resumed from the recorded step-6 checkpoint, equal to the
last float), and the comparison naming a step that differs."""

from tests.helpers import REPO, load_script, run_script

CASE = "dense-unified-adamw-1rank"


def test_one_case_records_and_checks_identical(tmp_path):
    recorded = run_script("bit_matrix.py", "record", tmp_path, "--cases", CASE)
    assert recorded.returncode == 0, recorded.stdout + recorded.stderr
    assert recorded.stdout.splitlines()[-1] == "all 1 case(s) identical"  # the resumed run repeats the full one
    checked = run_script("bit_matrix.py", "check", tmp_path, "--cases", CASE)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines() == [f"{CASE}: identical", "all 1 case(s) identical"]


def test_a_difference_is_named_by_step():
    matrix = load_script(REPO / "scripts" / "bit_matrix.py")
    want = {"loss": [[7, 5.25], [8, 5.125]], "grad_norm": [[7, 1.5], [8, 1.25]], "val_loss": [[9, 5.0]]}
    got = {"loss": [[7, 5.25], [8, 5.125000000000001]], "grad_norm": [[7, 1.5], [8, 1.25]], "val_loss": []}
    assert matrix.differences("case", want, got) == [
        "case: step 8 loss 5.125000000000001, expected 5.125", "case: 0 values of val_loss, expected 1"]
