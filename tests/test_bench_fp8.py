"""scripts/bench_fp8.py on the CPU: the distinct block-map shapes of a preset with the recipes whose
size filter converts them (each recipe once: the first H200 table named a recipe once per map of
the shape), and a table row per shape."""

import pytest

from tests.support.helpers import REPO, load_script


@pytest.fixture(scope="module")
def bench_fp8():
    return load_script(REPO / "scripts" / "bench_fp8.py")


def test_each_shape_lists_its_maps_and_the_recipes_that_convert_it(bench_fp8):
    # dense-1b: 2048 wide, k/v 512 out, FFN 8192; torchao's thresholds worked out by hand in
    # tests/parallel/test_fp8.py (tensorwise: q, o, gate, up, down; rowwise: gate, up)
    assert bench_fp8.shapes("dense-1b") == {
        (2048, 2048): {"maps": ["wq", "wo"], "auto": ["tensorwise"]},
        (512, 2048): {"maps": ["wk", "wv"], "auto": []},
        (8192, 2048): {"maps": ["w_gate", "w_up"],
                       "auto": ["tensorwise", "rowwise", "rowwise_with_gw_hp"]},
        (2048, 8192): {"maps": ["w_down"], "auto": ["tensorwise"]},
    }


def test_a_row_per_shape(bench_fp8, capsys):
    assert bench_fp8.main(["--presets", "dense-tiny", "--m", "32", "--steps", "1", "--warmup", "0",
                           "--no-compile"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| dense-tiny |")]
    assert [row.split(" | ")[1:3] for row in rows] == [
        ["wq,wo", "256 x 256"], ["wk,wv", "128 x 256"], ["w_gate,w_up", "688 x 256"],
        ["w_down", "256 x 688"]]
    assert all(row.endswith("| none |") for row in rows)
