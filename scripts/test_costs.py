"""What each test costs: wall-clock and CPU seconds per test, the most expensive first.

pytest's ``--durations`` gives wall-clock only, which on a shared machine measures the other
processes as much as the test. CPU seconds (this process and its finished children, all threads)
do not grow while the test waits for a core, so they rank tests the same on a busy machine as on
a quiet one. One line per test is appended to ``--log`` as it ends, so an interrupted run still
tells what it measured.

    python scripts/test_costs.py                          # the default suite (make test's selection)
    python scripts/test_costs.py --top 20 tests/cli       # pytest arguments after the options
    python scripts/test_costs.py --report costs.tsv       # rank an earlier log, run nothing
    VERISPEC_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/test_costs.py  # as on AVX2

Prints the total and the ``--top`` tests by CPU seconds: ``cpu_s  wall_s  test``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its children that have ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CostLog:
    """A pytest plugin: one ``test<TAB>wall_s<TAB>cpu_s`` line per test (setup, call and teardown)."""

    def __init__(self, path: Path):
        self.out = path.open("a", buffering=1, encoding="utf-8")
        self.started: dict[str, tuple[float, float]] = {}

    def pytest_runtest_logstart(self, nodeid, location):
        self.started[nodeid] = (time.perf_counter(), cpu_seconds())

    def pytest_runtest_logfinish(self, nodeid, location):
        wall, cpu = self.started.pop(nodeid)
        self.out.write(f"{nodeid}\t{time.perf_counter() - wall:.3f}\t{cpu_seconds() - cpu:.3f}\n")


def report(log: Path, top: int) -> None:
    rows = []
    for line in log.read_text(encoding="utf-8").splitlines():
        test, wall, cpu = line.rsplit("\t", 2)
        rows.append((float(cpu), float(wall), test))
    rows.sort(reverse=True)
    print(f"{len(rows)} tests: {sum(r[0] for r in rows):.0f} CPU s, {sum(r[1] for r in rows):.0f} wall s")
    for cpu, wall, test in rows[:top]:
        print(f"{cpu:8.1f} {wall:8.1f}  {test}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, default=Path("test_costs.tsv"), help="the per-test log (appended to)")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--report", type=Path, help="rank this log and run nothing")
    args, pytest_args = parser.parse_known_args()
    if args.report is not None:
        return report(args.report, args.top)
    import pytest

    args.log.unlink(missing_ok=True)
    code = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[CostLog(args.log)])
    report(args.log, args.top)
    sys.exit(code)


if __name__ == "__main__":
    main()
