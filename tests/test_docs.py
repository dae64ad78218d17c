"""Every reference in the repository's Markdown resolves.

A page names repository paths in backticks (`auk_triton/serving/config.py`), in commands
(`python3 benchmarks/bench_load.py`) and in links, Python modules by their dotted names
(`python -m auk_triton.front_door.launcher`), and other pages and their headings by links
(`[the front door](front-door.md#limits)`). Each of them must exist in the repository.

What is not a repository path is left alone: URLs, absolute paths, placeholders
(`<script>`, `*_gpu.py`, `...`), what a run writes (`.venv/`, `.cache/`, `perf_results/`)
and words with a slash that name no file (`application/json`, `p50/p99`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Folders that hold what a run or an install writes, never what a page may name.
UNINDEXED_DIRS = {"__pycache__", "build", "dist", "node_modules", "perf_results"}
# Path prefixes a page may name as what a run writes.
GENERATED_PREFIXES = (".venv/", ".cache/", "perf_results/", "build/", "dist/")
# A bare file name with one of these endings (`test_queue_limits.py`) names a repository file.
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".pbtxt", ".txt", ".toml", ".cfg", ".sh")
# File names that name a file of a checkpoint or of a client's run, not of the repository.
NOT_REPOSITORY_FILES = {"auk.safetensors", "vae.safetensors", "model.py"}
# Python packages a page may name by a dotted name, and where their sources are.
PACKAGES = {"auk_triton": ROOT / "auk_triton", "auk_client": ROOT / "client" / "auk_client"}
PLACEHOLDER_MARKS = ("<", ">", "*", "{", "}", "$", "~", "%", "...", "|")
MACHINE_PATHS = re.compile(r"(?<![\w.])(/home/\w|/Users/\w|/root/)")

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)((?:(?!\n[ \t]*\n).)+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^[ ]{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
HEADING = re.compile(r"^[ ]{0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$")
MODULE_NAME = re.compile(r"^(?:%s)(?:\.[A-Za-z_]\w*)+" % "|".join(PACKAGES))
AT_COMMIT = re.compile(r"^[0-9a-f]{7,40}:")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


@dataclass(frozen=True)
class Repository:
    """The repository's files and folders, as paths relative to its root."""

    root: Path
    files: frozenset[str]
    dirs: frozenset[str]

    @classmethod
    def scan(cls, root: Path) -> "Repository":
        files, dirs = set(), set()
        for folder, subdirs, names in os.walk(root):
            subdirs[:] = [
                d for d in subdirs if not d.startswith(".") and d not in UNINDEXED_DIRS and not d.endswith(".egg-info")
            ] + [d for d in subdirs if d == ".ci"]
            relative = Path(folder).relative_to(root).as_posix()
            prefix = "" if relative == "." else relative + "/"
            dirs.update(prefix + d for d in subdirs)
            files.update(prefix + name for name in names)
        return cls(root, frozenset(files), frozenset(dirs))

    def has(self, relative: str) -> bool:
        relative = relative.rstrip("/")
        return relative == "" or relative in self.files or relative in self.dirs

    def top_level(self) -> set[str]:
        return {path.split("/")[0] for path in self.files | self.dirs}

    def markdown_pages(self) -> list[str]:
        return sorted(path for path in self.files if path.endswith(".md"))


def _fenced_lines(lines: list[str]) -> list[bool]:
    """For each line, whether it is code: inside (or opening or closing) a fenced block, or
    an indented block (four spaces, after a blank line or another indented code line)."""
    fenced, inside, marker = [], False, ""
    for line in lines:
        match = FENCE.match(line)
        if match and (not inside or match.group(1) == marker):
            fenced.append(True)
            inside, marker = not inside, match.group(1)
        elif inside:
            fenced.append(True)
        else:
            indented = line.startswith(("    ", "\t")) and line.strip() != ""
            after = not fenced or fenced[-1] or lines[len(fenced) - 1].strip() == ""
            fenced.append(indented and after)
    return fenced


def heading_slug(text: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    lines = markdown.splitlines()
    anchors, seen = set(), {}
    for line, fenced in zip(lines, _fenced_lines(lines)):
        match = None if fenced else HEADING.match(line)
        if match:
            slug = heading_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


def _clean_token(raw: str) -> str | None:
    """The path or module a word of code may name, or None for one that names neither."""
    token = raw.strip("\"'`()[],;")
    if not token or "://" in token or any(mark in token for mark in PLACEHOLDER_MARKS):
        return None
    if AT_COMMIT.match(token):
        return None  # a file as it was at a commit (`1a3ac43:benchmarks/bench_fused_conv.py`)
    token = token.split("=")[-1].split(":")[-1].rstrip(",.;")
    if token.startswith("./"):
        token = token[2:]
    if not token or token.startswith(("/", "-", "#")) or token in (".", ".."):
        return None
    return token


def _module_defines(source: str, name: str) -> bool:
    """Whether a module's source defines or imports `name`."""
    pattern = (
        rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*(?::|=)|^\s*(?:from\s+\S+\s+)?import\b.*\b{name}\b"
    )
    return re.search(pattern, source, re.MULTILINE) is not None


def module_problem(dotted: str) -> str | None:
    """Why a dotted name (`auk_triton.front_door.launcher`, `auk_client.pipeline.generate_latents`)
    names nothing: its longest prefix that is a module must define the next part."""
    parts = dotted.split(".")
    where = PACKAGES[parts[0]]
    for index, part in enumerate(parts[1:], start=1):
        if (where / part / "__init__.py").is_file() if where.is_dir() else False:
            where = where / part
            continue
        if where.is_dir() and (where / f"{part}.py").is_file():
            where = where / f"{part}.py"
            continue
        source_file = where / "__init__.py" if where.is_dir() else where
        source = source_file.read_text(encoding="utf-8") if source_file.is_file() else ""
        if _module_defines(source, part):
            return None
        module = ".".join(parts[:index])
        return f"module `{dotted}`: `{module}` has no module or name `{part}`"
    return None


def path_problem(token: str, page: str, repo: Repository, top_level: set[str], in_fence: bool) -> str | None:
    """Why `token`, a word of code on `page`, names a repository path that does not exist;
    None when it exists or names no repository path."""
    if token.startswith(GENERATED_PREFIXES):
        return None
    page_dir = str(Path(page).parent.as_posix())
    page_dir = "" if page_dir == "." else page_dir + "/"
    if token.startswith("../"):
        if in_fence:
            return None  # relative to a command's own folder
        resolved = os.path.normpath(page_dir + token)
        return None if repo.has(Path(resolved).as_posix()) else f"path `{token}` (from {page_dir}) does not exist"
    if "/" in token:
        first = token.split("/")[0]
        if first in top_level:
            if in_fence and not token.endswith(FILE_SUFFIXES):
                return None  # a command's folder argument may be one it creates
            return None if repo.has(token) else f"path `{token}` does not exist"
        if repo.has(page_dir + first):
            return None if repo.has(page_dir + token) else f"path `{token}` (from {page_dir or 'the root'}) does not exist"
        if token.endswith(FILE_SUFFIXES) and not in_fence:
            tail = "/" + token
            if any(path.endswith(tail) for path in repo.files):
                return None
            return f"path `{token}` is the end of no file's path"
        return None
    if token.endswith(FILE_SUFFIXES) and not in_fence and token not in NOT_REPOSITORY_FILES:
        if not MODULE_NAME.match(token) and not any(path.split("/")[-1] == token for path in repo.files):
            return f"file `{token}` is nowhere in the repository"
    return None


def code_words(markdown: str):
    """(line, word, in a fenced block) for every word of code on a page."""
    lines = markdown.splitlines()
    fenced = _fenced_lines(lines)
    prose = "\n".join("" if f else line for line, f in zip(lines, fenced))
    for match in CODE_SPAN.finditer(prose):
        line = _line_of(prose, match.start())
        for word in match.group(2).split():
            yield line, word, False
    for number, (line, f) in enumerate(zip(lines, fenced), start=1):
        if f and not FENCE.match(line):
            for word in line.split():
                yield number, word, True


def link_targets(markdown: str):
    """(line, target) for every Markdown link and reference definition outside code."""
    lines = markdown.splitlines()
    fenced = _fenced_lines(lines)
    prose = "\n".join("" if f else line for line, f in zip(lines, fenced))
    prose = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    for match in LINK.finditer(prose):
        yield _line_of(prose, match.start()), match.group(1)
    for match in REFERENCE_DEFINITION.finditer(prose):
        yield _line_of(prose, match.start()), match.group(1)


def link_problem(target: str, page: str, repo: Repository) -> str | None:
    """Why a link on `page` leads nowhere: a missing page or file, or a missing heading."""
    if SCHEME.match(target):
        return None  # a URL (https:, mailto:)
    path, _, anchor = target.partition("#")
    if path.startswith("/"):
        return f"link `{target}` is absolute; link pages relative to each other"
    resolved = os.path.normpath((Path(page).parent / path).as_posix()) if path else page
    resolved = Path(resolved).as_posix()
    if resolved.startswith("../") or resolved == "..":
        return f"link `{target}` leaves the repository"
    if not repo.has("" if resolved == "." else resolved):
        return f"link `{target}`: {resolved} does not exist"
    if anchor:
        if not resolved.endswith(".md"):
            return f"link `{target}`: an anchor needs a Markdown page"
        anchors = heading_anchors((repo.root / resolved).read_text(encoding="utf-8"))
        if anchor not in anchors:
            return f"link `{target}`: {resolved} has no heading with anchor #{anchor}"
    return None


def files_at_commits(markdown: str) -> set[str]:
    """The files a page names as they were at a commit (`0d9be10:benchmarks/bench_conv_as_gemm.py`):
    a study of a dropped experiment may run a script the repository no longer holds."""
    return {word.strip("\"'`()[],;").split(":", 1)[1] for _, word, _ in code_words(markdown)
            if AT_COMMIT.match(word.strip("\"'`()[],;"))}


def page_problems(page: str, markdown: str, repo: Repository) -> list[str]:
    """Every reference on one page that does not resolve, as `page:line: why`."""
    top_level = repo.top_level()
    removed = files_at_commits(markdown)
    problems = []
    for line, word, in_fence in code_words(markdown):
        token = _clean_token(word)
        if token is None or token in removed:
            continue
        module = MODULE_NAME.match(token)
        why = module_problem(module.group(0)) if module else path_problem(token, page, repo, top_level, in_fence)
        if why:
            problems.append(f"{page}:{line}: {why}")
    for line, target in link_targets(markdown):
        why = link_problem(target, page, repo)
        if why:
            problems.append(f"{page}:{line}: {why}")
    return problems


def _read(repo: Repository, page: str) -> str:
    return (repo.root / page).read_text(encoding="utf-8")


REPO = Repository.scan(ROOT)


def test_every_page_is_found():
    pages = REPO.markdown_pages()
    for page in ("README.md", "docs/architecture.md", "deploy/README.md", "benchmarks/RESULTS.md"):
        assert page in pages


def test_every_path_module_and_link_named_in_the_docs_resolves():
    problems = [problem for page in REPO.markdown_pages() for problem in page_problems(page, _read(REPO, page), REPO)]
    assert not problems, f"{len(problems)} references lead nowhere:\n" + "\n".join(problems)


def test_no_page_names_a_path_of_the_machine_it_was_written_on():
    found = [
        f"{page}:{_line_of(text, m.start())}: {m.group(0)}"
        for page in REPO.markdown_pages()
        for text in [_read(REPO, page)]
        for m in MACHINE_PATHS.finditer(text)
    ]
    assert not found, "\n".join(found)


def test_the_readme_is_read_in_200_lines_and_the_results_page_in_150():
    readme_lines = len(_read(REPO, "README.md").splitlines())
    results_lines = len(_read(REPO, "benchmarks/RESULTS.md").splitlines())
    assert readme_lines <= 200, f"README.md has {readme_lines} lines"
    assert results_lines <= 150, f"benchmarks/RESULTS.md has {results_lines} lines"


def test_a_missing_file_module_page_or_heading_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "real.py").write_text("def present():\n    pass\n")
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## HTTP/2 and its attacks\n")
    page = "\n".join([
        "# Title",
        "`pkg/real.py` and `pkg/gone.py`, `real.py` and `gone.py`, `application/json`, `../pkg/real.py`.",
        "`auk_triton.no_such_module`, `auk_triton.codec.no_such_name` and `auk_triton.codec`.",
        "[fine](other.md#http2-and-its-attacks) [no page](missing.md) [no heading](other.md#nowhere)",
        "[this page](#title) [no heading here](#nothing) [a URL](https://example.com/x.md) [up](../pkg/)",
        "`.venv/bin/python`, `perf_results/gpu`, `<script>.py`, `*_gpu.py`, `abc1234:pkg/dropped.py`.",
        "```bash",
        "python3 pkg/real.py && python3 pkg/also_gone.py --out-dir pkg/made_by_the_run",
        "python3 pkg/dropped.py",
        "```",
        "",
        "    python3 pkg/indented_gone.py",
    ])
    (tmp_path / "docs" / "page.md").write_text(page)
    repo = Repository.scan(tmp_path)
    problems = page_problems("docs/page.md", page, repo)
    reported = "\n".join(problems)
    for missing in ("`pkg/gone.py`", "`gone.py`", "no_such_module", "no_such_name", "missing.md", "#nowhere",
                    "#nothing", "pkg/also_gone.py", "pkg/indented_gone.py"):
        assert missing in reported, f"{missing} not reported in:\n{reported}"
    assert len(problems) == 9, reported


def test_a_heading_anchor_follows_githubs_rules():
    text = "# The front door\n## HTTP/2 and its attacks\n### `auk_dit`\n## /dev/shm\n## Limits\n## Limits\n```\n# not a heading\n```"
    assert heading_anchors(text) == {
        "the-front-door", "http2-and-its-attacks", "auk_dit", "devshm", "limits", "limits-1",
    }
