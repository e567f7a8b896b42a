"""Where the test suite's CPU goes: a pytest plugin that measures each test's CPU seconds, its own
(the pytest process) and its processes' (every descendant reaped by the time it ends, as the kernel
counts them: not those a fork server or a process pool starts, which outlive the test), beside its
wall time, and writes one line per test to a TSV file; `report` sums them per file. Wall time alone
misleads on two shared cores: a test that waits (a hang's deliberate bound) costs wall but no CPU,
and one whose processes train costs CPU its own process never shows.

    python -m pytest -p dev.suite_cpu -n 2 --dist loadfile      (writes $SUITE_CPU_TSV,
                                                                 default /tmp/suite_cpu.tsv)
    python dev/suite_cpu.py report [TSV] [N]                    the N costliest files and tests
"""

import os
import resource
import sys
import time
from collections import defaultdict

import pytest

TSV = os.environ.get("SUITE_CPU_TSV", "/tmp/suite_cpu.tsv")


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown together: a module fixture's processes count for the test that
    first needs them, as pytest's durations count them."""
    wall, own, children = time.monotonic(), _cpu(resource.RUSAGE_SELF), \
        _cpu(resource.RUSAGE_CHILDREN)
    yield
    row = (item.nodeid, time.monotonic() - wall, _cpu(resource.RUSAGE_SELF) - own,
           _cpu(resource.RUSAGE_CHILDREN) - children)
    with open(TSV, "a") as out:
        out.write("\t".join([row[0], *(f"{x:.2f}" for x in row[1:])]) + "\n")


def report(path: str, top: int) -> None:
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    tests = []
    with open(path) as rows:
        for line in rows:
            nodeid, *numbers = line.rstrip("\n").split("\t")
            wall, own, children = map(float, numbers)
            tests.append((own + children, wall, own, children, nodeid))
            for i, x in enumerate((wall, own, children)):
                files[nodeid.split("::")[0]][i] += x
    total = [sum(f[i] for f in files.values()) for i in range(3)]
    print(f"{len(tests)} tests: wall {total[0]:.0f} s, CPU {total[1] + total[2]:.0f} s "
          f"(pytest's processes {total[1]:.0f} s, the processes they started {total[2]:.0f} s)\n")
    print("| file | CPU s | own | children | wall s |\n|---|---:|---:|---:|---:|")
    costliest = sorted(files.items(), key=lambda f: -f[1][1] - f[1][2])[:top]
    for name, (wall, own, children) in costliest:
        print(f"| {name} | {own + children:.1f} | {own:.1f} | {children:.1f} | {wall:.1f} |")
    print("\n| test | CPU s | own | children | wall s |\n|---|---:|---:|---:|---:|")
    for cpu, wall, own, children, nodeid in sorted(tests, reverse=True)[:top]:
        print(f"| {nodeid[:110]} | {cpu:.1f} | {own:.1f} | {children:.1f} | {wall:.1f} |")


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] != "report":
        sys.exit(__doc__)
    report(sys.argv[2] if len(sys.argv) > 2 else TSV, int(sys.argv[3]) if len(sys.argv) > 3 else 40)
