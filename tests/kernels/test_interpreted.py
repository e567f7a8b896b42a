"""The kernels run by triton's interpreter on CPU: every test file's test_interp_ tests in one child
process with TRITON_INTERPRET=1 (tests/support/kernels.py)."""

import pytest

from scalevec_kernels.backend import INTERPRETED
from tests.support.kernels import interpreted_files, run_interpreted


@pytest.mark.skipif(INTERPRETED, reason="this process runs the test_interp_ tests itself")
def test_triton_kernels_in_interpreter():
    files = interpreted_files()
    # the kernels' own files and the model's and compile's paths through them
    assert {p.name for p in files} >= {"test_rms_norm.py", "test_swiglu_norm.py",
                                       "test_head_rms_norm.py", "test_fused_kernels.py",
                                       "test_compile.py"}
    run_interpreted(files)
