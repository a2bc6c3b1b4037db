"""The project's own design document: every "DESIGN §n" reference in the code, tests and bench
scripts names a section that docs/design.md has."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_design_references_resolve():
    doc = (ROOT / "docs" / "design.md").read_text()
    sections = {m.group(1) for m in re.finditer(r"^#{2,3} §(\d+(?:\.\d+)?)\b", doc, flags=re.M)}
    assert {"1", "2", "3.1", "3.4", "9", "10", "11"} <= sections, sections
    refs = []
    for folder in ("k3tail", "triton_kernels", "cute_fallback", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for m in re.finditer(r"DESIGN §(\d+(?:\.\d+)?)", path.read_text()):
                refs.append((path.relative_to(ROOT), m.group(1)))
    assert len(refs) > 20, "the code no longer cites the design document?"
    missing = sorted({(str(p), s) for p, s in refs if s not in sections})
    assert not missing, f"DESIGN references with no section in docs/design.md: {missing}"
