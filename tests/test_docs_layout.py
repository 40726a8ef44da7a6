"""Every stage README follows one template (DEVELOPING.md, "Docs"): a reader who knows one
finds the same things in the same places in the others."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO

STAGE_READMES = sorted(REPO.glob("stages/*/README.md"))


def template_errors(name: str, text: str) -> list[str]:
    """The title names the stage and says what it does; `## Engines` comes first; `## Knobs` is there."""
    lines = text.splitlines()
    headings = [line for line in lines if line.startswith("## ")]
    errors = []
    if not lines or not re.fullmatch(rf"# Stage `{name}`: \S.*", lines[0]):
        errors.append(f"the title is not '# Stage `{name}`: <what it does>'")
    if not headings or headings[0] != "## Engines":
        errors.append("the first section is not '## Engines'")
    if not any(h == "## Knobs" or h.startswith("## Knobs (") for h in headings):
        errors.append("there is no '## Knobs' section")
    return errors


@pytest.mark.parametrize("path", STAGE_READMES, ids=lambda p: p.parent.name)
def test_a_stage_readme_follows_the_template(path: Path) -> None:
    errors = template_errors(path.parent.name, path.read_text())
    assert not errors, f"{path.relative_to(REPO)}: " + "; ".join(errors)


def test_a_readme_off_the_template_is_named() -> None:
    assert template_errors("sft", "# Stage `sft`: fine-tuning\n\n## Engines\n\n## Knobs (params)\n") == []
    assert template_errors("sft", "# sft — fine-tuning\n\n## Knobs\n\n## Engines\n") == [
        "the title is not '# Stage `sft`: <what it does>'",
        "the first section is not '## Engines'",
    ]
    assert template_errors("rm", "# Stage `rm`: a reward model\n\n## Engines\n") == [
        "there is no '## Knobs' section"
    ]
