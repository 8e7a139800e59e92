"""How run-tests spreads a selection over processes: pure, so the unit tests can call it."""

import itertools
import os
from pathlib import Path

#: Parallel test processes: most tests wait on servers and worker subprocesses rather than compute.
WORKERS = 3
#: Options after which the tests run in one process, or in as many as the caller chose.
ONE_PROCESS = ("--pdb", "--trace", "--collect-only", "--co", "-n", "--numprocesses")


def parallel(args: list[str]) -> list[str]:
    """xdist's options, unless the run is better in one process.

    One process: when ``args`` choose the processes or need one, when the
    tests share a server they flush, and when they name only single tests
    (``path::name``) or tests/unit, which start faster than workers would.
    """
    if os.environ.get("CELERY_DEDUP_TEST_REDIS_URL"):
        return []
    for arg, following in itertools.pairwise([*args, ""]):
        if arg in ONE_PROCESS or arg.startswith(("-n", "--numprocesses=")):
            return []
        if arg == "-pno:xdist" or (arg == "-p" and following == "no:xdist"):
            return []
    paths = [arg for arg in args if not arg.startswith("-") and Path(arg.split("::")[0]).exists()]
    unit = Path(__file__).resolve().parent.parent / "tests" / "unit"
    if paths and all("::" in arg or Path(arg).resolve().is_relative_to(unit) for arg in paths):
        return []
    return ["-n", str(WORKERS), "--dist", "loadgroup"]
