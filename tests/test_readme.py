"""The README's quick start runs as written."""

import re
from pathlib import Path


def test_the_quick_start_runs_as_written(capsys):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md quick start", "exec"), {})
    out = capsys.readouterr().out
    assert "selected: " in out and "rank  backend" in out and "rejected: " in out
    assert "torch.Size([2, 8, 64])" in out
