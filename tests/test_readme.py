"""The README's two commands are what CI and a newcomer run: keep them and .ci/run in step."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(name):
    with open(os.path.join(ROOT, name)) as f:
        return f.read()


def test_ci_runs_the_readme_test_command_and_the_readme_opens_with_both_commands():
    commands = [line.strip() for line in read("README.md").split("## ")[0].splitlines() if line.startswith("    ")]
    assert len(commands) == 2
    main_job, tests = commands
    assert main_job.endswith("python -m numbaflash") and tests.endswith("python -m pytest")
    assert tests in read(".ci/run").splitlines()
