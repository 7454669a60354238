"""A pytest plugin for the GPU run's test stages: ``-p live_junit --live-junit PATH`` writes a JUnit XML file rewritten
(atomically) after every test, so a run killed at its time limit keeps every test that finished (pytest's own
``--junitxml`` writes only at the end). The suite's ``complete`` property is ``false`` until the session ends; with
``--live-junit-append`` an earlier step's tests in that file are kept ahead of this one's. Each case carries its
outcome (a ``failure``, ``error`` or ``skipped`` child with the message) and its seconds. tools/gpu/stages.py's test
stages put this folder, which holds nothing else, on ``PYTHONPATH``."""

from __future__ import annotations

import os
import re
import time
import xml.etree.ElementTree as ET

RANK = {"passed": 0, "skipped": 1, "failure": 2, "error": 3}
TEST_PARAMS = re.compile(r"def test_\w*\s*\(([^)]*)\)", re.S)


def pytest_addoption(parser):
    parser.addoption("--live-junit", metavar="PATH", default=None, help="JUnit XML rewritten after every test")
    parser.addoption(
        "--live-junit-append", action="store_true", help="keep the file's test cases, this session's after"
    )


def pytest_configure(config):
    path = config.getoption("live_junit")
    if path:
        writer = LiveJunit(path)
        if config.getoption("live_junit_append"):
            writer.cases.update(read_cases(path))
        config.pluginmanager.register(writer, "live-junit-writer")


def read_cases(path: str) -> dict[str, dict]:
    """The test cases a file written by :class:`LiveJunit` holds (none where there is no readable file)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    cases = {}
    for case in root.iter("testcase"):
        file, name = case.get("file") or "", case.get("name") or ""
        nodeid = file if name == file else f"{file}::{name}"
        child = next((c for c in case if c.tag in RANK), None)
        cases[nodeid] = {"outcome": child.tag if child is not None else "passed",
                         "message": (child.text or "") if child is not None else "",
                         "time": float(case.get("time") or 0.0)}  # fmt: skip
        if case.get("gpu"):
            cases[nodeid]["gpu"] = case.get("gpu") == "yes"
    return cases


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    return (report.longreprtext or "")[-4000:]


def may_hold_gpu_tests(path: str) -> bool:
    """Whether a test module's source marks a test ``gpu`` or has a test that takes the suite's ``device`` fixture
    (tests/conftest.py: its ``cuda`` parameter is marked ``gpu``)."""
    try:
        src = open(path, encoding="utf-8").read()
    except OSError:
        return True  # unknown: counted, not hidden
    return "mark.gpu" in src or any(re.search(r"\bdevice\b", params) for params in TEST_PARAMS.findall(src))


def _headline(text: str) -> str:
    """The exception line of a traceback (pytest marks it ``E   ``), else the text's end."""
    lines = [line[4:] for line in text.splitlines() if line.startswith("E   ")]
    return (lines[0] if lines else text)[-500:]


class LiveJunit:
    def __init__(self, path: str):
        self.path = path
        self.cases: dict[str, dict] = {}
        self.start = time.time()
        self.complete = False
        self.exitstatus = None

    def _outcome(self, nodeid: str, outcome: str, message: str = "", duration: float = 0.0) -> None:
        case = self.cases.setdefault(nodeid, {"outcome": "passed", "message": "", "time": 0.0})
        case["time"] += duration
        if RANK[outcome] > RANK[case["outcome"]]:
            case["outcome"], case["message"] = outcome, message

    def pytest_sessionstart(self, session):
        self.write()

    def pytest_collectreport(self, report):
        # A module that fails to import is an error; one skipped whole (``pytest.importorskip`` at module level, a
        # module-level skip) is a skipped case under the module's id, so what skipped it is on record. Its tests were
        # never collected, so whether ``-m gpu`` would have selected any is read from its source (``gpu`` attribute).
        if report.failed or report.skipped:
            nodeid = report.nodeid or "collection"
            self._outcome(nodeid, "error" if report.failed else "skipped", _message(report))
            self.cases[nodeid]["gpu"] = may_hold_gpu_tests(nodeid)
            self.write()

    def pytest_runtest_logreport(self, report):
        if report.failed:
            outcome = "failure" if report.when == "call" else "error"
        elif report.skipped:
            outcome = "skipped"
        else:
            outcome = "passed"
        self._outcome(report.nodeid, outcome, _message(report) if outcome != "passed" else "", report.duration)
        if report.when == "teardown":
            self.write()

    def pytest_sessionfinish(self, session, exitstatus):
        self.complete, self.exitstatus = True, int(exitstatus)
        self.write()

    def write(self) -> None:
        counts = {k: sum(c["outcome"] == k for c in self.cases.values()) for k in RANK}
        suite = ET.Element("testsuite", name="pytest", tests=str(len(self.cases)), failures=str(counts["failure"]),
                           errors=str(counts["error"]), skipped=str(counts["skipped"]),
                           time=f"{time.time() - self.start:.3f}")  # fmt: skip
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="complete", value="true" if self.complete else "false")
        ET.SubElement(props, "property", name="exitstatus", value=str(self.exitstatus))
        for nodeid, c in self.cases.items():
            path, _, name = nodeid.partition("::")
            classname = path.removesuffix(".py").replace("/", ".")
            case = ET.SubElement(suite, "testcase", classname=classname, name=name or path, file=path,
                                 time=f"{c['time']:.3f}")  # fmt: skip
            if "gpu" in c:
                case.set("gpu", "yes" if c["gpu"] else "no")
            if c["outcome"] != "passed":
                ET.SubElement(case, c["outcome"], message=_headline(c["message"])).text = c["message"]
        tmp = f"{self.path}.tmp"
        root = ET.Element("testsuites")
        root.append(suite)
        ET.ElementTree(root).write(tmp, encoding="utf-8", xml_declaration=True)
        os.replace(tmp, self.path)
