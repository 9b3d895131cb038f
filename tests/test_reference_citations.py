"""Every numbered-rule citation in the repository resolves to a heading of docs/reference.md,
and every rule documented there is cited somewhere (no dead rules).

Citation styles handled (NNN is a three-digit rule id starting with 0, optionally ".N"):
- a keyword "ref", "refs", "ref." or "reference" followed by an id, possibly across a line
  break ("(ref" at the end of one line, the id at the start of the next);
- lists continuing such a citation: ids separated by ",", "/", ";", "&", "and" or "or", each
  optionally repeated with its own keyword (the second and third ids of a list like
  "ref A, B, C" or "(ref A / B)");
- dotted ids anywhere ("000.3 padding, 000.4 temperature" in a descriptive list); the
  000.N form is distinctive enough not to need the keyword.

Ids are restricted to a leading 0 (the project's rules are 000.N, 002, 004) so that a benchmark
table cell such as "reference 1.38" (seconds) can never be read as a citation. Bare
three-digit ids without a keyword (a list like "... 002 zero-std groups, 004 ...") are not
detected; write the keyword.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"

ID = r"0\d{2}(?:\.\d+)?(?![\d.]*\d)"
KEYWORD = r"\bref(?:s|erence)?\.?"
SEP = r"(?:\s*[,/;&]\s*|\s+(?:and|or)\s+)"
# A keyword citation and its list continuation; ids are then picked out of the whole match.
CITATION = re.compile(rf"{KEYWORD}\s+{ID}(?:{SEP}(?:{KEYWORD}\s+)?{ID})*", re.IGNORECASE)
ID_IN_CITATION = re.compile(rf"(?<![\w.]){ID}")
# A dotted id with no keyword: not part of a longer number or word.
DOTTED = re.compile(r"(?<![\w.])(0\d{2}\.\d+)(?![\w]|\.\d)")
HEADING = re.compile(rf"^#{{2,3}} ({ID})(?:\s|$)", re.MULTILINE)

MIN_CITATIONS = 10


def cited_files() -> list[Path]:
    files: list[Path] = []
    for folder in ("grpo_cli", "tests", "scripts"):
        files += sorted((ROOT / folder).rglob("*.py"))
    files += sorted((ROOT / "conf").rglob("*.yaml"))
    files.append(ROOT / "README.md")
    files += sorted(p for p in (ROOT / "docs").glob("*.md") if p.resolve() != REFERENCE.resolve())
    this = Path(__file__).resolve()
    return [p for p in files if p.is_file() and p.resolve() != this]


def find_citations() -> list[tuple[str, str]]:
    """(rule id, "path:line") for every citation, each source position counted once."""
    found: dict[tuple[Path, int], str] = {}
    for path in cited_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in CITATION.finditer(text):
            for idm in ID_IN_CITATION.finditer(m.group(0)):
                found[(path, m.start() + idm.start())] = idm.group(0)
        for m in DOTTED.finditer(text):
            found.setdefault((path, m.start(1)), m.group(1))
    out = []
    for (path, offset), rule in sorted(found.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
        text = path.read_text(encoding="utf-8", errors="replace")
        line = text.count("\n", 0, offset) + 1
        out.append((rule, f"{path.relative_to(ROOT)}:{line}"))
    return out


def heading_ids() -> set[str]:
    return set(HEADING.findall(REFERENCE.read_text(encoding="utf-8")))


def test_every_citation_has_a_heading_in_docs_reference():
    citations = find_citations()
    by_id: dict[str, list[str]] = defaultdict(list)
    for rule, where in citations:
        by_id[rule].append(where)
    print(
        f"{len(citations)} citations of {len(by_id)} ids:",
        {rule: len(places) for rule, places in sorted(by_id.items())},
    )
    assert len(citations) >= MIN_CITATIONS, (
        f"only {len(citations)} citations found (expected >= {MIN_CITATIONS}); "
        "the citation pattern or the file list is probably broken"
    )
    headings = heading_ids()
    unresolved = {rule: places for rule, places in sorted(by_id.items()) if rule not in headings}
    assert not unresolved, (
        "citations with no '## <id> ...' heading in docs/reference.md:\n"
        + "\n".join(f"  {rule}: cited at {', '.join(places)}" for rule, places in unresolved.items())
        + f"\nheadings present: {sorted(headings)}"
    )


def test_every_documented_rule_is_cited():
    headings = heading_ids()
    assert headings, "docs/reference.md has no '## <id> ...' headings"
    cited = {rule for rule, _ in find_citations()}
    dead = sorted(headings - cited)
    assert not dead, f"rules documented in docs/reference.md but cited nowhere: {dead}"
