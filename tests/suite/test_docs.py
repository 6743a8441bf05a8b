"""The docs against the code: every command README.md and docs/*.md show still parses with the real parsers, and
every repo file they cite exists. In-process argparse (and one `--help` per script); nothing is measured."""
from __future__ import annotations

import argparse
import functools
import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import early_jobs

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "results" / "baselines" / "INDEX.md"]

# A shown command starts with one of these (after `VAR=value` prefixes and a leading `.ci/install &&`).
STARTS = ("verifybench", "python3 -m verifybench", "python -m verifybench", "torchrun", "python3 scripts/",
          "scripts/", "pytest", "python3 -m pytest")
# A synopsis names options with placeholders (`[--out DIR]`, `<component>`, `a|b`, `TRACE...`): only its command
# and option names are checked. Anything else is parsed whole, as a user would type it.
SYNOPSIS = re.compile(r"[\[\]<>|]|\.\.")
REPO_ROOTS = ("harness", "kernels", "microbench", "tests", "scripts", "docs", "results", ".ci")
# A repo path: not part of a longer word, a URL, or `git show SHA:path` (history, not the tree).
CITED = re.compile(r"(?<![\w./:~$-])((?:%s)/[\w./*<>-]*[\w*/>])" % "|".join(re.escape(r) for r in REPO_ROOTS))


def shown_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for each command in a fenced block line or an inline code span of markdown `text` (a
    span may run over the lines of its paragraph)."""
    found, fenced, pending, paragraph = [], False, "", []

    def spans_of_paragraph():
        if paragraph:
            joined = " ".join(line.strip() for _, line in paragraph).replace("\\|", "|")
            for span in re.findall(r"`([^`]+)`", joined):
                command = _command_of(span)
                if command:
                    found.append((paragraph[0][0], command))
            paragraph.clear()

    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            spans_of_paragraph()
            fenced = not fenced
            continue
        if not fenced:
            if line.lstrip().startswith("|"):  # a table row is a paragraph of its own
                spans_of_paragraph()
                paragraph.append((number, line))
                spans_of_paragraph()
            elif line.strip():
                paragraph.append((number, line))
            else:
                spans_of_paragraph()
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        command = _command_of(line)
        if command:
            found.append((number, command))
    spans_of_paragraph()
    return found


def _command_of(span: str) -> str | None:
    span = span.strip().removeprefix("$ ")
    span = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", span)  # environment assignments
    span = re.sub(r"^\.ci/install\s*&&\s*", "", span)
    span = re.sub(r"\s+#\s.*$", "", span)  # a trailing comment
    return span if span.startswith(STARTS) and " " in span or span == "verifybench" else None


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


@functools.cache
def _cli() -> argparse.ArgumentParser:
    from verifybench.harness import cli

    return cli.build_parser()


@functools.cache
def _module_parser(module: str) -> argparse.ArgumentParser:
    return importlib.import_module(module).build_parser()


# The commands whose `--help` the docs' commands are checked against (scripts whose parser lives inside main()):
# read in a job started at collection (tests/early_jobs.py), since each is a process start of a few seconds
HELP_COMMANDS = ((sys.executable, "-m", "pytest", "-p", "no:cacheprovider"),
                 (sys.executable, "scripts/defaults_vs_tuned.py"))


def _help_run(argv: tuple[str, ...]) -> subprocess.CompletedProcess:
    return early_jobs.run([*argv, "--help"], 120, cwd=REPO, env=early_jobs.ENVIRON)


EARLY_JOBS = {"help_runs": lambda: {argv: _help_run(argv) for argv in HELP_COMMANDS}}
_HELP_RUNS: dict[tuple[str, ...], subprocess.CompletedProcess] = {}


@pytest.fixture(scope="module")
def help_runs():
    _HELP_RUNS.update(early_jobs.job_result(f"{__name__}::help_runs", EARLY_JOBS["help_runs"]))


def _help_options(argv: tuple[str, ...]) -> frozenset[str]:
    """The option names a command's `--help` lists."""
    r = _HELP_RUNS.get(argv) or _HELP_RUNS.setdefault(argv, _help_run(argv))
    assert r.returncode == 0, f"{' '.join(argv)} --help exited {r.returncode}: {r.stderr.strip()[-300:]}"
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", r.stdout))


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """None if `parser` accepts `argv`, else its complaint."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        if e.code:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
    return None


def _unknown_options(argv: list[str], known: set[str] | frozenset[str]) -> list[str]:
    names = [t.split("=", 1)[0] for t in argv if t.startswith("-") and t not in ("-", "--")]
    # a known one-letter option may carry its value joined (pytest's -rfE)
    joined = [n for n in names if not n.startswith("--") and n[:2] in known]
    return [n for n in names if n not in known and n not in joined and not re.fullmatch(r"-[A-Za-z]", n)]


def problems_of(command: str) -> list[str]:
    """What is wrong with one shown command: an unknown command or option, arguments the parser refuses, a repo
    file or folder it names that is not there. [] when it parses."""
    synopsis = bool(SYNOPSIS.search(command))
    try:
        argv = shlex.split(re.sub(r"[\[\]]", " ", command) if synopsis else command)
    except ValueError as e:
        return [f"cannot be split into words: {e}"]
    problems = []
    if argv[:2] == ["python3", "-m"] or argv[:2] == ["python", "-m"]:
        argv = argv[2:]
        if argv and argv[0] == "pytest":
            argv[0] = "pytest"
    if argv[0] in ("verifybench", "verifybench.harness", "verifybench.harness.cli"):
        return _problems_cli(argv[1:], synopsis)
    if argv[0] == "torchrun":
        if "-m" not in argv:
            return ["torchrun without -m MODULE"]
        i = argv.index("-m")
        from torch.distributed.run import get_args_parser

        problems += [f"torchrun has no option {o}" for o in _unknown_options(argv[1:i], _options(get_args_parser()))]
        argv = argv[i + 1:]
        if not argv or not argv[0].startswith("verifybench."):
            return problems + [f"-m {argv[0] if argv else ''}: not a verifybench module"]
    if argv[0].startswith("verifybench.harness"):
        try:
            parser = _module_parser(argv[0])
        except (ImportError, AttributeError) as e:
            return problems + [f"{argv[0]}: {e}"]
        return problems + _problems_parser(parser, argv[1:], synopsis, argv[0])
    if argv[0] == "pytest":
        problems += [f"pytest has no option {o}" for o in _unknown_options(argv[1:], _help_options(
            (sys.executable, "-m", "pytest", "-p", "no:cacheprovider")))]
        return problems + [f"{p}: no such path" for p in argv[1:] if p.endswith("/") and not (REPO / p).exists()]
    script = argv[1] if argv[0] in ("python3", "python") else argv[0]
    if not (REPO / script).is_file():
        return [f"{script}: no such file"]
    if script.endswith(".py"):
        problems += [f"{script} has no option {o}" for o in
                     _unknown_options(argv[2:], _help_options((sys.executable, script)))]
    return problems


def _problems_cli(argv: list[str], synopsis: bool) -> list[str]:
    if argv[:1] == ["..."]:  # `verifybench ...`: any command
        return []
    if not argv or argv[0].startswith("-"):
        return [] if not argv else [p for p in [_parse(_cli(), argv)] if p]
    commands = _subparsers(_cli())
    if argv[0].startswith("<"):  # `verifybench <component> [same options]`: every component has the run options
        return _problems_parser(commands["run"], argv[1:], True, "verifybench <component>")
    if argv[0] not in commands:
        return [f"verifybench has no command {argv[0]!r}"]
    # Prose names a command or an option without its arguments (`verifybench run --tokens` passes ...).
    if synopsis or len(argv) == 1 or _takes_value(commands[argv[0]], argv[-1]):
        return _problems_parser(commands[argv[0]], argv[1:], True, f"verifybench {argv[0]}")
    complaint = _parse(_cli(), argv)
    return [complaint] if complaint else []


def _takes_value(parser: argparse.ArgumentParser, token: str) -> bool:
    return any(token in a.option_strings and a.nargs != 0 for a in parser._actions)


def _problems_parser(parser: argparse.ArgumentParser, argv: list[str], synopsis: bool, name: str) -> list[str]:
    problems = [f"{name} has no option {o}" for o in _unknown_options(argv, _options(parser))]
    if not synopsis and not problems:
        complaint = _parse(parser, argv)
        problems += [complaint] if complaint else []
    return problems


def cited_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) for each repo path the markdown names (placeholders like <machine> left out)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for path in CITED.findall(line):
            path = path.split("::")[0].rstrip(".")
            if "<" not in path and "{" not in path:
                found.append((number, path))
    return found


def _exists(path: str) -> bool:
    """In the checkout, or a folder git ignores that a script fetches (.ci/run's .ci/engines): a fresh clone has no
    such folder until that script runs, and the README's test command runs before it."""
    if any(REPO.glob(path)) if "*" in path else (REPO / path).exists():
        return True
    return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode == 0


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_a_doc_shows_parses(doc, help_runs):
    wrong = [f"{doc.name}:{n}: `{c}`: {p}" for n, c in shown_commands(doc.read_text()) for p in problems_of(c)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repo_file_a_doc_cites_exists(doc):
    missing = [f"{doc.name}:{n}: {p}" for n, p in cited_paths(doc.read_text()) if not _exists(p)]
    assert not missing, "\n".join(missing)


CITES_SECTION = re.compile(r"""\((README|docs/[\w-]+\.md), ['"]([^'"]+)['"]""")


def cited_sections(text: str) -> list[tuple[str, str]]:
    """(doc, words) for each place a text points a reader to a doc's section: (README, 'words') or
    (docs/x.md, "words")."""
    return [(doc if doc.endswith(".md") else "README.md", words) for doc, words in CITES_SECTION.findall(text)]


def test_every_doc_section_the_code_and_docs_cite_exists():
    sources = [*(REPO / "harness").rglob("*.py"), *(REPO / "kernels").rglob("*.py"), *DOCS]
    cites = [(f, doc, words) for f in sources for doc, words in cited_sections(f.read_text())]
    assert cites, "no citation found: the pattern no longer matches the messages"
    missing = [f"{f.relative_to(REPO)}: ({doc}, '{words}')" for f, doc, words in cites
               if words not in " ".join((REPO / doc).read_text().split())]
    assert not missing, "\n".join(missing)


def test_the_docs_check_refuses_a_section_that_is_not_there():
    (doc, words), = cited_sections("""compare them within one process (docs/FINDINGS.md, "Host noise").""")
    assert (doc, words) == ("docs/FINDINGS.md", "Host noise")
    assert words not in (REPO / doc).read_text()


def test_the_readme_shows_its_two_commands_first():
    commands = [c for _, c in shown_commands((REPO / "README.md").read_text())]
    assert commands[:2] == ["verifybench run", "python3 -m pytest"], commands[:2]


@pytest.mark.parametrize("command", [
    "verifybench run verify",                                  # a positional `run` does not take
    "verifybench run --no-such-option",
    "verifybench no_such_command --out DIR",
    "verifybench compare [--no-such-option]",                  # a synopsis naming an option that is gone
    "verifybench <component> [--no-such-option]",
    "verifybench compare ONLY_BASE",                           # a positional missing
    "torchrun --nproc-per-node=2 -m verifybench.harness.multigpu.verify --no-such-option",
    "torchrun --no-such-launcher-option -m verifybench.harness.multigpu.allreduce",
    "python3 -m verifybench.harness.no_such_module --x",
    "python3 scripts/no_such_script.py OUT.json",
    "python3 scripts/defaults_vs_tuned.py OUT.json --no-such-option",
    "pytest --benchmark-only no_such_folder/",
])
def test_the_docs_check_refuses_a_command_that_no_longer_parses(command, help_runs):
    assert problems_of(command), command


@pytest.mark.parametrize("command", [
    "verifybench run --components verify",
    "verifybench <component> [--preset --tp --context --tokens 1,2,4,8 --out DIR]",
    "torchrun --nproc-per-node=2 -m verifybench.harness.multigpu.verify --tokens 1,4",
    "python3 -m verifybench.harness.multigpu.allreduce --nccl-sweep --nproc-per-node=2 [--list]",
    "pytest --benchmark-only microbench/",
])
def test_the_docs_check_accepts_a_command_that_parses(command, help_runs):
    assert problems_of(command) == [], command


def test_the_docs_check_finds_commands_in_blocks_and_spans_and_missing_files():
    text = ("Run `verifybench env --json` or `verifybench\nbreakeven --accept-len 2.5`:\n"
            "```bash\n.ci/install && verifybench run   # the main job\n"
            "FOO=1 torchrun --nproc-per-node=2 \\\n  -m verifybench.harness.multigpu.verify\n```\n"
            "See harness/no_such_file.py and `git show 226aae0:results/old.json`.\n")
    assert [c for _, c in shown_commands(text)] == [
        "verifybench env --json", "verifybench breakeven --accept-len 2.5", "verifybench run",
        "torchrun --nproc-per-node=2 -m verifybench.harness.multigpu.verify"]
    assert [p for _, p in cited_paths(text)] == [".ci/install", "harness/no_such_file.py"]
    assert not _exists("harness/no_such_file.py") and _exists("harness/cli.py")


def test_the_acceptance_script_runs_every_command_the_readme_and_the_guides_show():
    # FINDINGS and the baselines' INDEX show the measurements behind dated figures: parsed above, not re-run.
    script = (REPO / "scripts" / "acceptance.sh").read_text()
    guides = [d for d in DOCS if d.name not in ("FINDINGS.md", "FINDINGS-archive.md", "INDEX.md")]
    missing = []
    for doc in guides:
        for number, command in shown_commands(doc.read_text()):
            words = command.split()
            head = words[words.index("-m") + 1] if "-m" in words else " ".join(words[:2])
            if "<" not in head and head not in script:
                missing.append(f"{doc.name}:{number}: {head}")
    assert not missing, "\n".join(missing)


def commands_in_code(text: str) -> list[str]:
    """The commands a message or docstring tells a user, in backticks or parentheses: `verifybench ...`,
    (verifybench ...); "a / b" names two commands."""
    found = []
    for command in re.findall(r"[`(]((?:verifybench|torchrun|python3 -m verifybench)\b[^`()\n]*)[`)]", text):
        first, *others = [c.strip() for c in command.split(" / ")]
        found += [first] + [o if o.startswith("verifybench") else f"verifybench {o}" for o in others]
    return found


def _strings(path: Path) -> list[str]:
    """The string literals of a module (adjacent literals joined, as Python joins them); comments left out."""
    import ast

    return [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)]


def test_every_command_the_code_tells_a_user_parses():
    sources = [*(REPO / "harness").rglob("*.py"), *(REPO / "kernels").rglob("*.py"),
               *(REPO / "scripts").glob("*.py")]
    wrong = [f"{f.relative_to(REPO)}: `{c}`: {p}" for f in sources for text in _strings(f)
             for c in commands_in_code(text) for p in problems_of(c)]
    assert not wrong, "\n".join(wrong)


def test_the_code_check_refuses_the_command_a_message_gets_wrong():
    text = '''raise ValueError("a verify result, not a cycle result (verifybench run verify)")'''
    assert commands_in_code(text) == ["verifybench run verify"]
    assert problems_of("verifybench run verify")
    assert commands_in_code("(verifybench verify / run)") == ["verifybench verify", "verifybench run"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_markdown_file_a_doc_names_is_in_the_repository(doc):
    tracked = {p.name for p in REPO.rglob("*.md") if ".venv" not in p.parts}
    named = set(re.findall(r"(?<![\w*./-])([\w./-]*\w\.md)\b", doc.read_text()))
    assert not {n for n in named if Path(n).name not in tracked}, "named but not in the repository"


def test_the_readme_states_the_measured_test_time_with_its_machine_and_load():
    text = " ".join((REPO / "README.md").read_text().split())
    assert "2-core CPU boxes" in text and "load average 0.8 at the start" in text and "278 s" in text
    assert "loaded by other work (load average 2 to 6)" in text and "7:03 cold" in text
    assert "5:11 warm" in text and "6:35 on a fresh H100" in text and "2.5 minutes" not in text
