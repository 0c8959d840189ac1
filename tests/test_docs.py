"""The documentation against the code: the README's tables are checked
against the core they describe, and docs/design.md names every C file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvrecv
from kvrecv import KVConfig, KVTransferError, _core

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DESIGN = (ROOT / "docs" / "design.md").read_text()


def section(text: str, heading: str) -> str:
    """The body of a '## heading' section, up to the next '## '."""
    m = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"no section '## {heading}'"
    return m.group(1)


def table_rows(text: str) -> list:
    """The cells of every row of the first markdown table in text, header
    and separator rows left out."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def test_configuration_table_matches_the_core_defaults():
    rows = {r[0]: r[1] for r in table_rows(section(README, "Configuration"))}
    defaults = _core.config_defaults()
    fields = {f for f in KVConfig.__dataclass_fields__}
    assert set(rows) == fields, "the table and KVConfig name different fields"
    assert set(defaults) == fields - {"secret"}, "KVConfig and the core differ"
    for name, value in defaults.items():
        cell = rows[name]
        if isinstance(value, bool):
            assert cell == ("true" if value else "false"), name
        elif isinstance(value, str):
            assert cell == f"`{value}`", f"{name}: README says {cell}, core {value!r}"
        else:
            assert int(cell.split()[0]) == value, f"{name}: README says {cell}, core {value}"
    assert rows["secret"] == "(none)"


def test_kvconfig_defaults_are_the_core_defaults():
    cfg = KVConfig()
    for name, value in _core.config_defaults().items():
        got = getattr(cfg, name)
        assert got == value and type(got) is type(value), name
    assert cfg.secret == ""


def test_failure_code_table_matches_the_exception_classes():
    rows = {r[0]: r[1] for r in table_rows(section(README, "Failure codes"))}
    assert set(rows) == set(_core.failure_codes()), "the table and the core list different codes"
    for code, cls_name in rows.items():
        cls = getattr(kvrecv, cls_name)
        assert cls is getattr(_core, cls_name)
        assert issubclass(cls, KVTransferError)
        assert cls.default_code == code


def test_design_names_every_c_file():
    body = section(DESIGN, "The core by part")
    core, _, binding = body.partition("The binding (`csrc/python/`)")
    assert binding, "no paragraph on the binding"
    missing = [p.name for p in sorted((ROOT / "csrc").glob("*.c")) if f"`{p.name}`" not in core]
    missing += ["python/" + p.name for p in sorted((ROOT / "csrc" / "python").glob("*.c"))
                if f"`{p.name}`" not in binding]
    assert not missing, f"docs/design.md does not describe {missing}"


def test_faults_table_markers():
    begin, end = "<!-- faults-table:begin -->", "<!-- faults-table:end -->"
    assert README.count(begin) == 1 and README.count(end) == 1
    assert README.index(begin) < README.index(end)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(doc):
    text = doc.read_text()
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(target)
            continue
        if anchor and dest.suffix == ".md":
            heads = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
            if anchor not in {slug(h) for h in heads}:
                bad.append(target)
    assert not bad, f"{doc.name}: broken links {bad}"
