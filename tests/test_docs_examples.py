"""The docs' code runs as written (the doctest pass of the docs), and docs/examples/ runs.

- Every python block of the docs (README.md, CHANGELOG.md, docs/**/*.md) runs, in a fresh
  module per page, the page's blocks in order, as a reader would paste them. A block that
  raises, or holds a placeholder ``...``, fails its page's test, naming the page and line.
  A block with a ``# prints:`` comment must print the lines that follow it (each written
  ``# <line>``).
- A block that cannot run alone is an excerpt: the paragraph before it says
  ``Excerpt of [name](path.py)`` and the linked file is the complete one (it must exist,
  and each line of the excerpt must be in it). A ``{literalinclude}`` of part of a file is
  marked the same way, and its start/end markers must be in the file.
- Every file in docs/examples/ is run by a test here:
  - Flax ``TrainState`` + ``DynamicScale`` -> jamp: the same losses step for step (both
    skip the overflowing first step and land on the same scale), and jamp's skip leaves
    Adam's count where it was.
  - Equinox -> jamp.autocast: trains in fp16 next to the float32 loop, and a NaN batch is
    skipped exactly.
  - ZeRO in your own loop: the state split per stage, the same losses.
"""

import ast
import contextlib
import dataclasses
import functools
import importlib.util
import io
import math
import re
import sys
import traceback
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"
# docs/index.md and docs/changelog.md include these two; the guides and API pages are the rest.
PAGES = ["README.md", "CHANGELOG.md"] + sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
    if "_build" not in p.parts)
# Each file of docs/examples/ and the test that runs it (a new example needs a test here).
RUN_BY_TESTS = {
    "migrate_flax_dynamic_scale": "test_flax_dynamic_scale_migration_matches_step_for_step",
    "migrate_equinox": "test_equinox_migration_trains_in_fp16_and_skips_nan",
    "zero_own_loop": "test_zero_own_loop_splits_state_per_stage_and_trains_the_same",
}

# Fences at any indent: a block inside a list item is indented like the item's text.
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*?)\s*$")
_PYTHON_INFO = re.compile(r"^(?:python3?|py|\{(?:code-block|code|sourcecode|code-cell)\}\s+"
                          r"(?:python3?|py|ipython3?))$")
# MyST directives whose content is markdown, which may hold code blocks of its own.
_CONTAINERS = {"note", "warning", "tip", "important", "hint", "caution", "attention", "danger",
               "error", "seealso", "admonition", "dropdown", "topic", "sidebar", "margin"}
_EXCERPT = re.compile(r"\bexcerpt (?:of|from) \[[^\]]*\]\((?P<target>[^)\s#]+)", re.I)
_RST_CODE = re.compile(r"^\s*\.\. (?:code-block|code|sourcecode|literalinclude|doctest)::")


@dataclasses.dataclass(frozen=True)
class Block:
    """One python block of a docs page: a fenced block or a ``{literalinclude}``."""

    page: str  # repo-relative path of the page
    line: int  # 1-based line just above the code (the opening fence of a plain block)
    code: str  # the code (a fenced block) or "" (a literalinclude)
    include: str | None  # a literalinclude's file, repo-relative
    options: dict  # a literalinclude's options (start-at, end-before, ...)
    excerpt_of: str | None  # the file an "Excerpt of [..](..)" paragraph links, repo-relative

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _relative(page: str, target: str) -> str:
    path = ((ROOT / page).parent / target).resolve()
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _paragraph_before(lines: list[str], fence: int) -> str:
    """The paragraph that ends just above line index ``fence`` (blank lines skipped)."""
    i = fence - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    paragraph = []
    while i >= 0 and lines[i].strip() and not _FENCE.match(lines[i]):
        paragraph.append(lines[i].strip())
        i -= 1
    return " ".join(reversed(paragraph))


def _options(body: list[str]) -> tuple[dict, list[str]]:
    """A MyST directive's ``:key: value`` options and the rest of its body."""
    options, i = {}, 0
    while i < len(body) and (m := re.match(r"^:([\w-]+):\s*(.*)$", body[i])):
        options[m.group(1)] = m.group(2).strip().strip("\"'")
        i += 1
    if options and i < len(body) and not body[i].strip():
        i += 1
    return options, body[i:]


@functools.cache
def doc_blocks(page: str) -> tuple[Block, ...]:
    """Every python block of a page, in order (inside admonitions too)."""
    lines = (ROOT / page).read_text().splitlines()
    blocks, open_containers, i = [], [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info")
        if (open_containers and not info and fence[0] == open_containers[-1][0]
                and len(fence) >= len(open_containers[-1])):
            open_containers.pop()
            i += 1
            continue
        directive = re.match(r"^\{([\w-]+)\}\s*(.*)$", info)
        if directive and directive.group(1) in _CONTAINERS:
            open_containers.append(fence)
            i += 1
            continue
        end = i + 1  # the closing fence: same character, at least as long, no info
        while end < len(lines) and not re.match(
                rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            end += 1
        indent = len(m.group("indent"))  # removed from the body, as Markdown does
        body = [line[min(indent, len(line) - len(line.lstrip(" "))):]
                for line in lines[i + 1:end]]
        marked = _EXCERPT.search(_paragraph_before(lines, i))
        excerpt_of = _relative(page, marked.group("target")) if marked else None
        if _PYTHON_INFO.match(info):
            options, code = _options(body) if directive else ({}, body)
            blocks.append(Block(page, i + 1 + len(body) - len(code) if directive else i + 1,
                                "\n".join(code) + "\n", None, options, excerpt_of))
        elif directive and directive.group(1) == "literalinclude":
            options, _ = _options(body)
            language = options.get("language", Path(directive.group(2)).suffix[1:])
            if language in ("python", "py", "python3"):
                blocks.append(Block(page, i + 1, "", _relative(page, directive.group(2)),
                                    options, excerpt_of))
        i = end + 1
    return tuple(blocks)


def included_text(block: Block) -> str:
    """What Sphinx's literalinclude shows of its file (start/end markers, ``lines``)."""
    text = (ROOT / block.include).read_text()
    opts = block.options
    if "lines" in opts:
        raise NotImplementedError(f"{block.where}: use :start-at:/:end-before:, not :lines:")
    for key in ("start-at", "start-after"):
        if key in opts:
            at = text.index(opts[key])
            text = text[at:] if key == "start-at" else text[at + len(opts[key]):].split(
                "\n", 1)[1]
    for key in ("end-at", "end-before"):
        if key in opts:
            at = text.index(opts[key])
            text = text[:at] if key == "end-before" else text[:text.index("\n", at) + 1]
    return text


def _placeholders(code: str) -> list[int]:
    """Lines of ``...`` used as a value (``loss = ...``), not as an index (``x[..., 0]``)."""
    tree = ast.parse(code)
    indices = {id(n) for s in ast.walk(tree) if isinstance(s, ast.Subscript)
               for n in ast.walk(s.slice)}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and n.value is Ellipsis and id(n) not in indices]


def _expected_output(block: Block) -> list[str] | None:
    """The lines after a ``# prints:`` comment, each written ``# <line>``; None without one."""
    lines = block.code.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().lower() == "# prints:"]
    if not starts:
        return None
    expected = []
    for line in lines[starts[-1] + 1:]:
        if not line.startswith("#"):
            break
        expected.append(line[2:] if line.startswith("# ") else line[1:])
    return expected


class DocBlockError(AssertionError):
    pass


@functools.cache
def run_page(page: str) -> tuple[dict, tuple[str, ...]]:
    """Runs a page's runnable blocks in order in one fresh module; its namespace, outputs.

    Each block is compiled with the page as its file name and its own line numbers, so a
    traceback points into the page.
    """
    name = "docs_page_" + re.sub(r"\W", "_", page)
    module = types.ModuleType(name)
    module.__file__ = str(ROOT / page)
    sys.modules[name] = module  # dataclasses (linen modules) look their module up here
    outputs = []
    try:
        for block in doc_blocks(page):
            if block.include or block.excerpt_of:
                continue
            out = io.StringIO()
            source = "\n" * block.line + block.code  # the page's own line numbers
            for line in _placeholders(source):
                raise DocBlockError(f"{page}:{line}: a placeholder `...` in a block that runs: "
                                    "write the code, or mark the block as an excerpt "
                                    "('Excerpt of [file](path.py)')")
            try:
                code = compile(source, str(ROOT / page), "exec")
                with contextlib.redirect_stdout(out):
                    exec(code, module.__dict__)
            except Exception as e:
                frames = [f for f in traceback.extract_tb(e.__traceback__)
                          if f.filename == str(ROOT / page)]
                line = frames[-1].lineno if frames else block.line
                raise DocBlockError(
                    f"{page}:{line}: the python block at {block.where} raised "
                    f"{type(e).__name__}: {e}\n(mark it 'Excerpt of [file](path.py)' if it "
                    f"is not meant to run alone)\n"
                    + "".join(traceback.format_exception(e))) from e
            printed = out.getvalue()
            sys.stdout.write(printed)
            expected = _expected_output(block)
            if expected is not None and printed.splitlines() != expected:
                raise DocBlockError(f"{block.where}: the block printed\n{printed}but its "
                                    f"'# prints:' comment says\n" + "\n".join(expected))
            outputs.append(printed)
    finally:
        sys.modules.pop(name, None)
    return module.__dict__, tuple(outputs)


def _fence_lines(page: str) -> int:
    """A grep-level count of the page's python fences and literalincludes (parser check)."""
    count = 0
    for line in (ROOT / page).read_text().splitlines():
        m = _FENCE.match(line)
        if m and (_PYTHON_INFO.match(m.group("info"))
                  or m.group("info").startswith("{literalinclude}")):
            count += 1
    return count


def test_the_docs_have_python_blocks_and_the_parser_finds_them_all():
    found = {page: len(doc_blocks(page)) for page in PAGES}
    missed = {page: (found[page], _fence_lines(page)) for page in PAGES
              if found[page] != _fence_lines(page)}
    assert not missed, (f"python blocks the parser did not find (found, fences): {missed}; "
                        "inside a container directive missing from _CONTAINERS?")
    assert sum(found.values()) >= 10  # README, zero, modes, nnx, coming_from, migrate, ...
    rst_code = [f"{page}:{n}" for page in PAGES
                for n, line in enumerate((ROOT / page).read_text().splitlines(), 1)
                if _RST_CODE.match(line)]
    assert not rst_code, f"rst code blocks are not run; write them as ```python fences: {rst_code}"


def test_every_excerpt_links_the_existing_file_it_is_cut_from():
    problems = []
    for page in PAGES:
        for block in doc_blocks(page):
            target = block.excerpt_of
            if target and not (target.endswith(".py") and (ROOT / target).is_file()):
                problems.append(f"{block.where}: marked as an excerpt of {target}, which is "
                                "not an existing .py file")
                continue
            if target and target.startswith("docs/examples/") and (
                    Path(target).stem not in RUN_BY_TESTS):
                problems.append(f"{block.where}: {target} is run by no test")
            if block.include:
                if not (ROOT / block.include).is_file():
                    problems.append(f"{block.where}: literalinclude of a missing file "
                                    f"{block.include}")
                    continue
                partial = bool({"start-at", "start-after", "end-at", "end-before", "lines",
                                "pyobject"} & set(block.options))
                if partial and target != block.include:
                    problems.append(f"{block.where}: a part of {block.include} is shown; the "
                                    f"paragraph before it must say 'Excerpt of [...]("
                                    f"path to {block.include})' (it links {target})")
                try:
                    included_text(block)
                except ValueError:
                    problems.append(f"{block.where}: a start/end marker of "
                                    f"{block.options} is not in {block.include}")
            elif target:
                source = (ROOT / target).read_text()
                for n, line in enumerate(block.code.splitlines(), block.line + 1):
                    if line.strip() and line.strip() != "..." and line.strip() not in source:
                        problems.append(f"{block.page}:{n}: this excerpt line is not in "
                                        f"{target}: {line.strip()!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [p for p in PAGES if any(
    not (b.include or b.excerpt_of) for b in doc_blocks(p))])
def test_the_python_blocks_of_the_page_run_as_written(page):
    run_page(page)


def test_every_docs_example_file_is_run_by_a_test():
    assert {p.stem for p in EXAMPLES.glob("*.py")} == set(RUN_BY_TESTS)
    names = set(globals())
    assert set(RUN_BY_TESTS.values()) <= names


def test_the_migration_guide_counts_the_lines_it_marks():
    numbers = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}
    text = (ROOT / "docs/guides/migrate.md").read_text()
    said = re.search(r"\b(\w+) lines\s+change", text).group(1).lower()
    (shown,) = [b for b in doc_blocks("docs/guides/migrate.md")
                if b.include == "docs/examples/migrate_equinox.py"]
    assert included_text(shown).count("# changed") == numbers[said]
    whole = (ROOT / shown.include).read_text()
    assert whole.count("# changed") == numbers[said]  # none left outside the excerpt


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flax_dynamic_scale_migration_matches_step_for_step():
    out = _load("migrate_flax_dynamic_scale").main(steps=5)
    before, after = out["losses"]["before"], out["losses"]["after"]
    assert math.isnan(before[0]) and math.isnan(after[0])  # the inf batch
    assert before[1:] == after[1:]
    assert out["before_scale"] == out["after_scale"] == 2.0**15
    assert out["after_skipped"] == 1 and out["adam_count"] == 4


def test_equinox_migration_trains_in_fp16_and_skips_nan():
    pytest.importorskip("equinox")
    out = _load("migrate_equinox").main(steps=5)
    before, after = out["losses"]["before"], out["losses"]["after"]
    assert math.isnan(after[1])
    assert out["skipped"] == 2  # 2**16 overflows float16 once, then the NaN batch
    assert out["scale"] == 2.0**14
    assert abs(after[-1] - before[2]) < 2e-2  # two skipped steps behind float32
    assert after[-1] < after[0]


def test_zero_own_loop_splits_state_per_stage_and_trains_the_same():
    import jax
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    example = _load("zero_own_loop")
    runs = {stage: example.main(steps=4, stage=stage) for stage in (0, 1, 2, 3)}
    split, whole = P(None, "data"), P()
    assert [runs[s]["master_or_mu_spec"] for s in range(4)] == [whole, split, split, split]
    assert [runs[s]["param_spec"] for s in range(4)] == [whole, whole, whole, split]
    for stage in (1, 2, 3):  # the NaN batch skipped on every stage; the same losses
        assert runs[stage]["skipped"] == runs[0]["skipped"] == [0, 1, 1, 1]
        assert runs[stage]["losses"][2:] == pytest.approx(runs[0]["losses"][2:], rel=1e-6)
        assert runs[stage]["loss_scale"] == runs[0]["loss_scale"]


def test_the_readme_ten_lines_print_what_they_say():
    _, outputs = run_page("README.md")
    runnable = [b for b in doc_blocks("README.md") if not (b.include or b.excerpt_of)]
    block, printed = next((b, out) for b, out in zip(runnable, outputs, strict=True)
                          if "boosted.step" in b.code)
    promised = [line.split(":")[0].lstrip("# ") for line in block.code.splitlines()
                if line.startswith("# True") or line.startswith("# False")]
    assert printed.splitlines() == promised == ["True 65536.0 1", "False 32768.0 1"]


def test_the_zero_guide_code_splits_the_params():
    import jax

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    scope, _ = run_page("docs/guides/zero.md")
    kernel = scope["state"].params["layers_0"]["kernel"]
    assert "data" in str(kernel.sharding.spec) and not bool(scope["metrics"]["skipped"])
