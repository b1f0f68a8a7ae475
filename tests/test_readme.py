"""The README's tour runs as written, and CI runs the README's test command."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.slow  # runs every README tour end to end (~2.5 minutes)
def test_readme_tours_run():
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    runnable = [b for b in blocks if "..." not in b]  # the traversal cheat-sheet is not code
    assert len(runnable) >= 2
    for tour in runnable:
        exec(compile(tour, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    block = re.search(r"<!-- test-command -->\n```bash\n(.*?)\n```\n<!-- /test-command -->", README)
    assert block is not None
    assert "pytest" in block.group(1)
    assert "test-command" in (ROOT / ".ci" / "run").read_text()
