"""GPU tests of N ranks on fewer GPUs, run as N rank processes (`jax_moe_publish.testing.rank_processes`).

A test marked ``rank_processes`` that needs more GPUs than there are (``gpus(n)``) does not skip
where ranks can share a GPU: the parent runs it in n child pytest processes, one per rank, that
join one ``jax.distributed`` job and run the same test body in lockstep. On as many GPUs as
ranks it runs as written, in one process.

The tests of one module and group size run in one launch (a batch), in collection order, so that
the children pay their start and compiles once. Each child appends every test's outcome to a
file of the launch's folder as it goes; the parent reports each test from those: failed where
any rank process failed it, passed where every one passed its body, skipped where they skipped,
and failed, naming the rank processes, where they ended before reaching it.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile
import threading
import time

import pytest

from jax_moe_publish.testing import rank_processes

MARKER = "rank_processes"
RANKS = pytest.StashKey[int]()
STARTUP_S = 180.0
"""Budget of a child's start: imports, joining, collection."""
PER_TEST_S = 240.0
"""Budget of one test in a child: a child still in one test after this ends itself."""
OUTCOMES = "outcomes-{process}.jsonl"


def ranks_of(item) -> int | None:
    """The ranks a test runs as processes here; None where it runs (or skips) as written."""
    return item.stash.get(RANKS, None)


def run_as_processes(item, ranks: int) -> None:
    item.stash[RANKS] = ranks


class Batches:
    """The parent side: launches each (module, ranks) batch when its first test comes, then
    answers every test of it from the children's outcomes."""

    def __init__(self, config) -> None:
        self.config = config
        self.results: dict[tuple, dict] = {}
        self.items: list = []

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        self.items = list(items)  # after -m and -k

    @pytest.hookimpl(tryfirst=True)
    def pytest_pyfunc_call(self, pyfuncitem):
        ranks = ranks_of(pyfuncitem)
        if ranks is None:
            return None
        key = (str(pyfuncitem.path), ranks)
        if key not in self.results:
            self.results[key] = self._launch(key)
        _report(self.results[key], pyfuncitem.nodeid)
        return True

    def _launch(self, key) -> dict:
        path, ranks = key
        batch = [item for item in self.items if (str(item.path), ranks_of(item)) == key]
        ids = [f"{item.path}::{item.nodeid.split('::', 1)[1]}" for item in batch]
        seed = int.from_bytes(os.urandom(4), "little")
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "-s",
                   "--rootdir", str(self.config.rootpath), f"--hypothesis-seed={seed}", *ids]
        if self.config.inipath is not None:
            command[3:3] = ["-c", str(self.config.inipath)]
        deadline = STARTUP_S + PER_TEST_S * len(batch)
        self._say(f"{pathlib.Path(path).name}: {len(batch)} test(s) as {ranks} rank processes")
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="jax-moe-publish-ranks-") as folder:
            outcomes = rank_processes.launch(command, ranks, deadline_s=deadline, seed=seed, folder=folder,
                                             extra_env={
                                                 # The children report here; the parent decides whether GPU tests ran.
                                                 "JAX_MOE_PUBLISH_REQUIRE_GPU": "0", "PYTHONUNBUFFERED": "1"})
            records = [_read_records(pathlib.Path(folder) / OUTCOMES.format(process=p)) for p in range(ranks)]
        self._say(f"{pathlib.Path(path).name}: {ranks} rank processes ended in {time.monotonic() - start:.0f} s "
                  f"({', '.join(o.describe() for o in outcomes)})")
        return {"outcomes": outcomes, "records": records}

    def _say(self, line: str) -> None:
        """A line in pytest's output, past its capture."""
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(line)


def _read_records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _report(batch: dict, nodeid: str) -> None:
    """Pass, fail or skip ``nodeid`` as its rank processes did."""
    outcomes = batch["outcomes"]
    records = [[r for r in process_records if r["nodeid"] == nodeid] for process_records in batch["records"]]
    failed = [(p, r) for p, rs in enumerate(records) for r in rs if r["outcome"] == "failed"]
    if failed:
        lines = [f"rank process {p} ({r['when']}): {r['message']}" for p, r in failed]
        pytest.fail("\n".join(lines), pytrace=False)
    passed = [any(r["when"] == "call" and r["outcome"] == "passed" for r in rs) for rs in records]
    if all(passed):
        return
    skips = [r["message"] for rs in records for r in rs if r["outcome"] == "skipped"]
    if skips and not any(passed):
        pytest.skip(skips[0])
    missing = [p for p, ok in enumerate(passed) if not ok]
    tails = "\n".join(f"--- {outcomes[p].describe()}\n{outcomes[p].stdout[-3000:]}\n{outcomes[p].stderr[-3000:]}"
                      for p in missing)
    pytest.fail(f"rank process(es) {missing} ended before finishing this test\n{tails}", pytrace=False)


class Child:
    """The child side: records each test's outcome, ends a test that outlives `PER_TEST_S`, and
    leaves through `local_processes.leave` (the coordinator's process goes last)."""

    def __init__(self, rank: rank_processes.RankProcess) -> None:
        self.rank = rank
        self.path = pathlib.Path(rank.folder) / OUTCOMES.format(process=rank.process)
        self.exitstatus = 1
        self._current: tuple[str, float] | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _record(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def pytest_runtest_logstart(self, nodeid, location):
        self._current = (nodeid, time.monotonic())

    def pytest_runtest_logreport(self, report):
        if report.failed or report.when == "call" or report.skipped:
            message = ""
            if report.failed:
                message = report.longreprtext[-6000:]
            elif report.skipped:
                message = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self._record({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                          "message": message})

    def pytest_runtest_logfinish(self, nodeid, location):
        self._current = None

    def _watch(self) -> None:
        while True:
            time.sleep(1.0)
            current = self._current
            if current is not None and time.monotonic() - current[1] > PER_TEST_S:
                self._record({"nodeid": current[0], "when": "call", "outcome": "failed",
                              "message": f"still running after {PER_TEST_S:g} s: ended"})
                os._exit(3)

    def pytest_sessionfinish(self, session, exitstatus):
        self.exitstatus = int(exitstatus)

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config):
        from jax_moe_publish.testing import local_processes

        local_processes.leave(self.exitstatus)
