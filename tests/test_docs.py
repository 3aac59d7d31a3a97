"""README.md and docs/*.md stay true to the repository: every relative link and image points to a file (an
anchor to one of its headings), every repository path named in code exists, every sentence that says a test backs it
names that test, and the README stays short."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250  # a newcomer reads it in five minutes; the rest lives in docs/
PATH_PREFIXES = ("examples", "bench", "scripts", "tests", "docs", "baton", ".ci")

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
REPO_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*)" % "|".join(re.escape(p) for p in PATH_PREFIXES))
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
# A sentence that says a test backs it: "tested", "a test ...", "tests check", "checked by a test".
CLAIM = re.compile(r"\b(?:tested|a test|tests? checks?|checked by a test)\b(?![- ]suite)", re.IGNORECASE)
# A test named as `tests/test_x.py::test_name` (or ::Class::test_name), a parametrised case's [id] allowed.
CITATION = re.compile(r"\btests/(test_\w+\.py)((?:::\w+)+)(?:\[[^\]\s]*\])?")
TEST_FILE = re.compile(r"\btests/test_\w+\.py\b(?!::)")
SENTENCE_END = re.compile(r"(?<=[.!?])[)*]?\s+(?=[A-Z(`*])")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def split_code(text: str) -> tuple[str, list[tuple[int, str]]]:
    """The prose of a markdown text, with fenced blocks blanked (line numbers kept), and the fenced blocks
    as (first line number, text). A backtick fence's info string has no backtick (CommonMark)."""
    prose, blocks, fence, start, body = [], [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            match = FENCE.match(line)
            if match and not (match.group(1)[0] == "`" and "`" in match.group(2)):
                fence, start, body = match.group(1), number, []
                prose.append("")
            else:
                prose.append(line)
        else:
            prose.append("")
            if line.strip() and set(line.strip()) == {fence[0]} and len(line.strip()) >= len(fence):
                blocks.append((start, "\n".join(body)))
                fence = None
            else:
                body.append(line)
    if fence is not None:  # an unclosed fence runs to the end of the file
        blocks.append((start, "\n".join(body)))
    return "\n".join(prose), blocks


def inline_code(prose: str) -> list[tuple[int, str]]:
    """(line number, text) of each inline code span, per paragraph (a span never crosses a blank line)."""
    spans, offset = [], 0
    for paragraph in re.split(r"(\n[ \t]*\n)", prose):
        for match in INLINE_CODE.finditer(paragraph):
            spans.append((prose.count("\n", 0, offset + match.start()) + 1, match.group(2)))
        offset += len(paragraph)
    return spans


def without_inline_code(prose: str) -> str:
    """The prose with each inline code span replaced by a word, its line breaks kept, so links are found
    only outside code and their line numbers stay right."""
    parts = re.split(r"(\n[ \t]*\n)", prose)
    return "".join(INLINE_CODE.sub(lambda m: "code" + "\n" * m.group(0).count("\n"), part) for part in parts)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file (a repeated heading gets -1, -2, ...)."""
    prose, _ = split_code(path.read_text(encoding="utf-8"))
    slugs, counts = set(), {}
    for line in prose.splitlines():
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(1))
            count = counts.get(slug, 0)
            counts[slug] = count + 1
            slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    text = path.read_text(encoding="utf-8")
    prose, _ = split_code(text)
    prose = without_inline_code(prose)
    name = path.relative_to(root).as_posix()
    problems = []
    for match in LINK.finditer(prose):
        target = match.group(1)
        line = prose.count("\n", 0, match.start()) + 1
        if SCHEME.match(target):
            continue  # http(s), mailto: not checked here
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{name}:{line}: link {target!r}: no file {file_part!r}")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            problems.append(f"{name}:{line}: link {target!r}: no heading with anchor #{anchor} in "
                            f"{linked.relative_to(root).as_posix()}")
    return problems


def path_problems(path: Path, root: Path = ROOT) -> list[str]:
    """Repository paths (examples/…, bench/…, baton/…, …, ending in a file extension or '/') named in fenced
    code or inline code that do not exist."""
    prose, blocks = split_code(path.read_text(encoding="utf-8"))
    name = path.relative_to(root).as_posix()
    problems = []
    for start, code in blocks + inline_code(prose):
        for offset, code_line in enumerate(code.splitlines()):
            for match in REPO_PATH.finditer(code_line):
                repo_path = match.group(1).rstrip(".")
                if not (repo_path.endswith("/") or re.search(r"\.[A-Za-z0-9]+$", repo_path.rsplit("/", 1)[-1])):
                    continue
                if not (root / repo_path).exists():
                    problems.append(f"{name}:{start + offset}: no such path {repo_path!r}")
    return problems


def sentences(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each sentence of the prose: paragraphs (list items and table rows apart) joined and
    split after '.', '!' or '?'; headings and fenced code left out."""
    prose, _ = split_code(path.read_text(encoding="utf-8"))
    out, block, start = [], [], 0

    def flush():
        text = " ".join(block)
        offset = 0
        for part in SENTENCE_END.split(text):
            out.append((start, part.strip()))
            offset += len(part)
        block.clear()

    for number, line in enumerate(prose.splitlines(), 1):
        stripped = line.strip()
        new_item = re.match(r"^([-*+]|\d+\.)\s|^\|", stripped)
        if not stripped or HEADING.match(line) or new_item:
            if block:
                flush()
            if stripped and not HEADING.match(line):
                block.append(stripped)
                start = number
            continue
        if not block:
            start = number
        block.append(stripped)
    if block:
        flush()
    return [(number, text) for number, text in out if text]


def functions_of(path: Path) -> set[str]:
    """'name' of each top-level test function and 'Class::name' of each method of a test file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{item.name}" for item in node.body
                      if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return names


def claim_problems(path: Path, root: Path = ROOT) -> list[str]:
    """A sentence that says it is tested, or names a test file, must name the test (`tests/test_x.py::test_name`),
    and each test it names must exist. A test file named in a command (a code span that runs pytest) is not a
    claim."""
    name = path.relative_to(root).as_posix()
    problems = []
    for line, sentence in sentences(path):
        without_commands = re.sub(r"`[^`]*pytest[^`]*`", "command", sentence)
        citations = CITATION.findall(without_commands)
        for file_name, test in citations:
            test_path = root / "tests" / file_name
            if not test_path.is_file():
                problems.append(f"{name}:{line}: no test file tests/{file_name}")
            elif test.lstrip(":") not in functions_of(test_path):
                problems.append(f"{name}:{line}: no test {test.lstrip(':')} in tests/{file_name}")
        if CLAIM.search(without_commands) and not citations:
            problems.append(f"{name}:{line}: says it is tested but names no test: {sentence!r}")
        for match in TEST_FILE.finditer(without_commands):
            problems.append(f"{name}:{line}: names {match.group(0)} without the test (::test_name): {sentence!r}")
    return problems


def test_every_claim_of_a_test_names_a_test_that_exists():
    problems = [problem for path in doc_files() for problem in claim_problems(path)]
    assert not problems, f"{len(problems)} claims without their test:\n" + "\n".join(problems)


def test_the_claim_check_finds_an_uncited_claim_and_a_missing_test(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_real.py").write_text("def test_it():\n    pass\n\n\nclass TestGroup:\n"
                                                    "    def test_method(self):\n        pass\n")
    (tmp_path / "README.md").write_text(
        "# Title\n\n"
        "It resumes exactly (tested). It trains alike (`tests/test_real.py::test_it`).\n"
        "Also grouped (`tests/test_real.py::TestGroup::test_method`, `tests/test_real.py::test_it[ray]`).\n\n"
        "- Gone (`tests/test_real.py::test_gone`), and a file alone (`tests/test_real.py`).\n"
        "- A test checks\n  the other, `tests/test_none.py::test_x`.\n\n"
        "Measured with `.venv/bin/python -m pytest -s tests/test_real.py`: a figure.\n\n"
        "## Tested\n\n```\ntested\n```\n")
    problems = claim_problems(tmp_path / "README.md", tmp_path)
    assert len(problems) == 4, problems
    assert "README.md:3: says it is tested but names no test: 'It resumes exactly (tested).'" in problems
    assert any("README.md:6: no test test_gone" in p for p in problems)
    assert any("README.md:6: names tests/test_real.py without" in p for p in problems)
    assert any("README.md:7: no test file tests/test_none.py" in p for p in problems)


def test_links_and_images_point_to_files_and_headings():
    problems = [problem for path in doc_files() for problem in link_problems(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_paths_named_in_code_exist():
    problems = [problem for path in doc_files() for problem in path_problems(path)]
    assert not problems, "paths that do not exist:\n" + "\n".join(problems)


def test_readme_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    num_lines = len(readme.splitlines())
    assert num_lines <= README_MAX_LINES, (
        f"README.md has {num_lines} lines (at most {README_MAX_LINES}): move detail into a docs/ page")
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(without_inline_code(readme))}
    orphans = [p.relative_to(ROOT).as_posix() for p in doc_files()[1:] if p.resolve() not in linked]
    assert not orphans, f"docs pages that README.md does not link: {orphans}"


def test_the_checks_find_a_broken_link_anchor_and_path(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "real.py").write_text("")
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## The `hf` strategy: fast\n")
    (tmp_path / "README.md").write_text(
        "# Title\n\n"
        "[ok](docs/page.md#the-hf-strategy-fast) [gone](docs/missing.md) [bad anchor](docs/page.md#nope)\n"
        "[self](#title) ![img](docs/missing.png) [web](https://example.com/x.md)\n\n"
        "Run `bench/real.py` and `bench/gone.py`; `docs/*.png` and `runs/x/out.json` are not checked.\n\n"
        "```bash\n.venv/bin/python bench/also_gone.py --json out.json   # [not a link](nowhere.md)\n```\n\n"
        "```` ```python ```` is inline code, not a fence: `examples/inline_gone.yaml`\n")
    readme = tmp_path / "README.md"
    links = link_problems(readme, tmp_path)
    assert len(links) == 3, links
    assert any("docs/missing.md" in p for p in links) and any("#nope" in p for p in links)
    assert any("README.md:4:" in p and "missing.png" in p for p in links)
    paths = path_problems(readme, tmp_path)
    assert sorted(p.split("'")[1] for p in paths) == ["bench/also_gone.py", "bench/gone.py",
                                                       "examples/inline_gone.yaml"], paths
