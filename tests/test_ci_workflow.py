"""The CI definitions: .github/workflows/ci.yml and .ci/run run the README's commands, then the
import contracts (lint-imports) and the regression benchmark.

actionlint (GitHub's workflow checker) runs on the workflow when it is on PATH; no wheel of the
upstream checker installs offline (its PyPI wrapper downloads the binary when built), so it is
not a dependency. Without it the structure GitHub needs is checked here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
LINT_IMPORTS = ".venv/bin/lint-imports"  # pyproject.toml's import contracts


def readme_test_command() -> str:
    """The README's 'Tests:' command: set up, install, run the whole suite."""
    lines = (ROOT / "README.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# Tests:"))
    return lines[at + 1].strip()


def install_and_test() -> tuple[str, str]:
    """The README's test command split into its install part and its pytest part."""
    install, test = readme_test_command().rsplit(" && ", 1)
    return install, test


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def runners(job: dict) -> list[str]:
    """The job's runner images, its matrix expanded."""
    runs_on = job["runs-on"]
    match = re.fullmatch(r"\$\{\{\s*matrix\.(\w+)\s*\}\}", runs_on)
    return job["strategy"]["matrix"][match.group(1)] if match else [runs_on]


def test_workflow_runs_on_push_and_pull_request():
    wf = workflow()
    triggers = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as true
    assert {"push", "pull_request"} <= set(triggers)


def test_workflow_has_a_macos_arm64_and_an_ubuntu_runner():
    images = [image for job in workflow()["jobs"].values() for image in runners(job)]
    macos = [int(m.group(1)) for i in images if (m := re.fullmatch(r"macos-(\d+)", i))]
    assert macos and max(macos) >= 14, images  # macos-14 and later are Apple silicon
    assert any(i.startswith("ubuntu-") for i in images), images


def test_every_job_installs_tests_benchmarks_and_uploads_results_as_the_readme_says():
    install, test = install_and_test()
    for name, job in workflow()["jobs"].items():
        steps = job["steps"]
        runs = [s["run"] for s in steps if "run" in s]
        uses = {s["uses"].split("@")[0]: s for s in steps if "uses" in s}
        assert install in runs, (name, runs)
        assert test in runs, (name, runs)
        assert any(r.startswith(".venv/bin/kvbench-regress") for r in runs), (name, runs)
        assert runs.index(install) < runs.index(test) < runs.index(LINT_IMPORTS), name
        assert "actions/checkout" in uses, name
        assert uses["actions/upload-artifact"]["with"]["path"].rstrip("/") == "results", name


def test_ci_run_runs_the_readme_test_command_then_the_import_contracts_and_the_benchmark():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    at = lines.index(readme_test_command())
    assert LINT_IMPORTS in lines[at + 1 :]
    assert any(line.startswith(".venv/bin/kvbench-regress") for line in lines[at + 1 :])


@pytest.mark.skipif(shutil.which("actionlint") is None, reason="actionlint is not on PATH")
def test_actionlint_finds_nothing():
    proc = subprocess.run(
        ["actionlint", "-color=false", str(WORKFLOW)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
