"""The spec's text holds together: RFC 2119 sentences are counted per document (a change of
normative text changes these numbers, deliberately), the reject list is numbered 1..N, every
"section N" / "item N" a document cites exists, and the normative text cites no implementation
file (modules move; the spec does not).

Counts of one document: ``python tests/test_spec_text.py spec/FORMAT.md spec/ROOTS.md``.
"""

from __future__ import annotations

import collections
import os
import re
import sys
from importlib import resources

SPEC = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "spec"))
DOCS = ("FORMAT.md", "FORMAT-v1.md", "ROOTS.md")
KEYWORDS = ("MUST NOT", "MUST", "SHOULD NOT", "SHOULD", "MAY", "REQUIRED")

# Sentences holding each key word, per document. A spec change that adds, removes or moves a
# normative sentence updates these with its CHANGELOG entry.
PINNED = {
    "FORMAT.md": {"MUST NOT": 21, "MUST": 59, "SHOULD NOT": 1, "SHOULD": 6, "MAY": 12, "REQUIRED": 2},
    "FORMAT-v1.md": {"MUST NOT": 18, "MUST": 54, "SHOULD NOT": 1, "SHOULD": 6, "MAY": 8, "REQUIRED": 2},
    "ROOTS.md": {"MUST NOT": 11, "MUST": 6, "SHOULD NOT": 0, "SHOULD": 0, "MAY": 4, "REQUIRED": 0},
}

_KEYWORD_RE = {k: re.compile(r"\b" + k.replace(" ", r"\s+") + (r"\b" if " " in k else r"\b(?!\s+NOT\b)"))
               for k in KEYWORDS}


def read(name: str) -> str:
    with open(os.path.join(SPEC, name), encoding="utf-8") as f:
        return f.read()


def sentences(text: str) -> list[str]:
    """Split markdown into sentences: fenced code dropped; paragraphs, list items, table rows
    and headings are blocks; a block splits after `.`, `!` or `?` followed by a capital, a
    backtick, a parenthesis or an asterisk."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    blocks: list[list[str]] = []
    for line in text.splitlines():
        s = line.strip()
        if not s:
            blocks.append([])
        elif s.startswith(("#", "|")) or re.match(r"(- |\d+\. )", s) or not blocks:
            blocks.append([s])
        else:
            blocks[-1].append(s)
    out = []
    for b in blocks:
        joined = " ".join(b)
        out.extend(p for p in re.split(r"(?<=[.!?])\s+(?=[A-Z`(*\"])", joined) if p)
    return out


def keyword_sentences(text: str) -> dict[str, list[str]]:
    """For each RFC 2119 key word, the sentences of ``text`` that use it (a sentence using two
    key words counts for both; MUST NOT is not counted as MUST)."""
    found = collections.defaultdict(list)
    for s in sentences(text):
        for k, rx in _KEYWORD_RE.items():
            if rx.search(s):
                found[k].append(s)
    return {k: found[k] for k in KEYWORDS}


def counts(text: str) -> dict[str, int]:
    return {k: len(v) for k, v in keyword_sentences(text).items()}


def test_rfc2119_sentence_counts_are_pinned():
    got = {name: counts(read(name)) for name in DOCS}
    assert got == PINNED


_LIST = r"(\d+(?:\.\d+)?(?:(?:,\s+|\s+and\s+|,\s+and\s+)\d+(?:\.\d+)?)*)(?![\d-])"
# In a spec document: "section 4.7", "sections 10 and 12", "`ROOTS.md` section 1" (a bare number
# is a section of the document itself, of FORMAT.md in CHANGELOG.md); "former section" is history.
_DOC_REF = re.compile(r"(?<!former )(?:`?(FORMAT|ROOTS)\.md`?\s+)?sections?\s+" + _LIST)
# In code and the README: "spec section 12", "spec/ROOTS.md section 1", "section 2 of the spec".
_CODE_REF = re.compile(r"(?i:spec)(?:/(FORMAT|ROOTS)\.md)?,?\s+(?:sections?\s+)?" + _LIST
                       + r"|sections?\s+" + _LIST + r"\s+of\s+the\s+spec")
_ITEM_REF = re.compile(r"\b[Ii]tems?\s+(\d+)(?:-(\d+)|\s+and\s+(\d+))?")


def headings(text: str) -> set[str]:
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.?\s", text, flags=re.M))


def reject_items(doc: str = "FORMAT.md") -> list[int]:
    """The numbers of ``doc``'s section 11 list, in order."""
    text = read(doc)
    body = text[text.index("\n## 11. "):text.index("\n## 12. ")]
    return [int(n) for n in re.findall(r"^(\d+)\. ", body, flags=re.M)]


def _numbers(group: str) -> list[str]:
    return re.split(r",\s+and\s+|,\s+|\s+and\s+", group)


def test_reject_list_is_numbered_contiguously():
    items = reject_items()
    assert items == list(range(1, len(items) + 1)) and len(items) >= 18


def test_every_cited_section_and_item_exists():
    known = {name[:-3]: headings(read(name)) for name in DOCS}
    n_items = len(reject_items())
    dangling = []
    for name, default in (("FORMAT.md", "FORMAT"), ("ROOTS.md", "ROOTS"), ("CHANGELOG.md", "FORMAT")):
        text = read(name)
        for m in _DOC_REF.finditer(text):
            dangling += [f"{name}: {m.group(0)!r}" for n in _numbers(m.group(2))
                         if n not in known[m.group(1) or default]]
        for m in _ITEM_REF.finditer(text):
            dangling += [f"{name}: {m.group(0)!r}" for n in m.groups() if n and int(n) > n_items]
    root = os.path.dirname(SPEC)
    sources = [os.path.join(root, "README.md")]
    for top in ("shardfmt", "reshard", "tests", "benchmarks", "examples"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            sources += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
    for path in sources:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for m in _CODE_REF.finditer(text):
            doc, group = (m.group(1) or "FORMAT", m.group(2)) if m.group(2) else ("FORMAT", m.group(3))
            dangling += [f"{os.path.relpath(path, root)}: {m.group(0)!r}"
                         for n in _numbers(group) if n not in known[doc]]
    assert not dangling, "references to sections or items that do not exist:\n" + "\n".join(dangling)


def test_spec_cites_no_implementation_file():
    """The normative text says what the reference implementation does, not where it does it."""
    for name in DOCS:
        cited = re.findall(r"[\w./-]+\.py\b|\b(?:shardfmt|reshard)/[\w./-]+", read(name))
        assert not cited, f"{name} cites {cited}"


def test_package_ships_the_spec_schema():
    """One schema: the package's is spec/manifest.schema.json (a link to it in the source tree)."""
    shipped = resources.files("shardfmt").joinpath("manifest.schema.json")
    with open(os.path.join(SPEC, "manifest.schema.json"), "rb") as f:
        assert shipped.read_bytes() == f.read()
    source = os.path.join(os.path.dirname(SPEC), "shardfmt", "manifest.schema.json")
    if str(shipped) == source:
        assert os.path.islink(source), "shardfmt/manifest.schema.json must stay a link to the spec's"


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            print(path, counts(f.read()))
