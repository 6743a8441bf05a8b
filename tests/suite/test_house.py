"""The house rules, checked from the code itself: one import root of our own name in the wheel, no import cycles,
no module importing a pytest module, kernels/ importing nothing of harness/, the engine importing no component, and
no module past MAX_MODULE_LINES without a reason."""
import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {"harness": "verifybench.harness", "kernels": "verifybench.kernels"}


def _modules() -> dict[str, Path]:
    """verifybench module name -> file, for every .py under harness/ and kernels/."""
    out = {}
    for folder, package in ROOTS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, module: str) -> set[str]:
    """Every module this file imports, at any depth of the file (lazy imports count), absolute names."""
    found = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(p, m) if i in mods and i != m} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph (node -> the nodes it imports): its strongly connected components of two or
    more nodes (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles(graph):
    cycles = _cycles(graph)
    assert not cycles, f"import cycles: {cycles}"


def test_kernels_import_nothing_of_harness(graph):
    bad = {m: sorted(i for i in deps if i.startswith("verifybench.harness")) for m, deps in graph.items()
           if m.startswith("verifybench.kernels")}
    assert not {m: d for m, d in bad.items() if d}


def test_engine_imports_no_component_model_or_application(graph):
    apps = ("verifybench.harness.components", "verifybench.harness.model", "verifybench.harness.multigpu",
            "verifybench.harness.tune", "verifybench.harness.analysis", "verifybench.harness.answers",
            "verifybench.harness.run",
            "verifybench.harness.cli")
    bad = {m: sorted(i for i in deps if i.startswith(apps)) for m, deps in graph.items()
           if m.startswith("verifybench.harness.measure")}
    assert not {m: d for m, d in bad.items() if d}


# The floors of the house, lowest first: a module imports only from its own room or from a lower floor. docs/design.md
# shows them as its "Code map"; a test holds the two equal.
FLOORS = (("kernels.common",), ("kernels.fused_ops",),
          ("kernels.graph_replay", "kernels.mla_decode", "kernels.mla_glue", "kernels.mla_verify", "kernels.moe_int4",
           "kernels.skinny_gemm", "kernels.tree"),
          ("harness.measure",), ("harness.engines",), ("harness.collectives",), ("harness.model",),
          ("harness.analysis",), ("harness.components",), ("harness.answers",),
          ("harness.multigpu", "harness.tune", "harness.run", "harness.record"), ("harness.cli",), ("harness.__main__",))


def _room(module: str) -> tuple[int, str]:
    rest = module.removeprefix("verifybench.")
    for floor, rooms in enumerate(FLOORS):
        for room in rooms:
            if rest == room or rest.startswith(room + "."):
                return floor, room
    return -1, rest


# harness/measure/ is one room with inner rooms, lowest first: what the machine is (host/), the timing engine and the
# run of a case (timing/), what a run stores and how runs compare (results/). An inner room imports from a lower one
# and from the modules at measure/'s top, never from a higher one; the top holds only MEASURE_TOP: what all three
# share (exit codes, the stance on CPU numbers, the limits) and the two commands over them (env, hostprobe).
MEASURE = "verifybench.harness.measure"
MEASURE_ROOMS = ("host", "timing", "results")
MEASURE_TOP = ("env", "exits", "hostnoise", "limits", "stance")


def _measure_room(module: str) -> str | None:
    """A harness/measure/ module's inner room, or its own name at measure/'s top; None outside harness/measure/."""
    return module.removeprefix(MEASURE + ".").split(".")[0] if module.startswith(MEASURE + ".") else None


def test_measures_inner_rooms_import_down_and_its_top_holds_only_what_they_share(graph):
    rooms = {m: _measure_room(m) for m in graph if _measure_room(m)}
    assert sorted(set(rooms.values()) - set(MEASURE_ROOMS)) == sorted(MEASURE_TOP), \
        "a module at harness/measure/'s top that is not in MEASURE_TOP: move it into a room, or name it there"
    up = [(m, i) for m, room in rooms.items() for i in graph[m] if room in MEASURE_ROOMS
          and rooms.get(i) in MEASURE_ROOMS and MEASURE_ROOMS.index(rooms[i]) > MEASURE_ROOMS.index(room)]
    assert not up, f"imports up the inner rooms {' < '.join(MEASURE_ROOMS)}: {up}"
    between = {}  # a room, or a module at the top, and what it imports of the others
    for m, room in rooms.items():
        between.setdefault(room, set()).update(rooms[i] for i in graph[m] if rooms.get(i) not in (None, room))
    assert not _cycles(between), f"harness/measure/'s rooms import each other in a cycle: {_cycles(between)}"
    text = (REPO / "docs" / "design.md").read_text()
    at = [text.find(f"`harness/measure/{room}/`") for room in MEASURE_ROOMS]
    assert -1 not in at and at == sorted(at), "docs/design.md's code map names the inner rooms, lowest first"


# The tests mirror the rooms (docs/design.md's code map says where): a room's tests lie in the tests/ folder named
# for it (harness/measure/ in tests/measure/, every room of kernels/ in tests/kernels/), the rooms named here in the
# folder they share. The folders are no packages: pytest imports each test file by its bare name, so a name is used
# once across them.
TESTS_SHARED = {"harness.collectives": "multigpu", "harness.run": "suite", "harness.record": "suite",
                "harness.cli": "suite", "harness.__main__": "suite"}


def _tests_folder(room: str) -> str:
    """The folder under tests/ that holds the tests of a room as FLOORS names it."""
    return "kernels" if room.startswith("kernels.") else TESTS_SHARED.get(room, room.removeprefix("harness."))


def test_every_room_has_its_tests_folder_and_every_test_file_lies_in_one():
    tests = REPO / "tests"
    folders = {_tests_folder(room) for rooms in FLOORS for room in rooms}
    empty = sorted(f for f in folders if not any((tests / f).glob("test_*.py")))
    assert not empty, f"rooms' tests folders holding no test file: {empty}"
    files = sorted(tests.rglob("test_*.py"))
    stray = [str(p.relative_to(tests)) for p in files if p.parent.parent != tests or p.parent.name not in folders]
    assert not stray, f"test files outside the rooms' folders {sorted(folders)}: {stray}"
    names = [p.name for p in files]
    twice = sorted({n for n in names if names.count(n) > 1})
    assert not twice, f"test file names used twice: {twice}"
    unnamed = sorted(f for f in folders if f"`tests/{f}/`" not in (REPO / "docs" / "design.md").read_text())
    assert not unnamed, f"docs/design.md's code map does not say where these rooms' tests live: {unnamed}"


def _code_map() -> list[tuple[str, tuple[str, ...], str]]:
    """(floor, rooms as FLOORS names them, may-import cell) per row of the "Code map" table in docs/design.md, where
    a room is written as its path (`harness/measure/`, `harness/run.py`)."""
    text = (REPO / "docs" / "design.md").read_text()
    assert "\n## Code map\n" in text, "docs/design.md has no '## Code map' section"
    rows = []
    for line in text.split("\n## Code map\n", 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            paths = re.findall(r"`([^`]+)`", cells[1])
            rooms = tuple(r.removesuffix("/").removesuffix(".py").replace("/", ".") for r in paths)
            rows.append((cells[0], rooms, cells[3]))
    return rows


def test_the_design_docs_code_map_is_these_floors():
    rows = _code_map()
    assert [r[0] for r in rows] == [str(i) for i in range(len(rows))], "the map's floors: 0, 1, 2, ... lowest first"
    assert tuple(r[1] for r in rows) == FLOORS, "docs/design.md's code map and FLOORS disagree: change both"
    may = [r[2] for r in rows]
    assert may == ["nothing of `harness/`", "floor 0", *(f"floors 0-{i - 1}" for i in range(2, len(rows)))]


def test_every_import_runs_down_the_floors_or_stays_in_its_room(graph):
    up = [(m, i) for m, deps in graph.items() for i in deps
          if _room(i)[1] != _room(m)[1] and _room(i)[0] >= _room(m)[0] and _room(m)[0] >= 0]
    assert not up, f"imports that run back up or sideways: {up}"
    unplaced = sorted(m for m in graph if _room(m)[0] < 0 and m not in ROOTS.values())
    assert not unplaced, f"modules on no floor: {unplaced}"


# A module a reader can hold: past this many lines it is split along a seam it has, or its first line says why not
MAX_MODULE_LINES = 400
REASON = "# Over 400 lines: "  # then the reason, on the module's first line


def _module_texts() -> dict[str, list[str]]:
    """The lines of every .py module of the suite outside tests/, by path relative to the repository."""
    return {str(p.relative_to(REPO)): p.read_text().splitlines()
            for folder in ("harness", "kernels", "scripts", "microbench") for p in (REPO / folder).rglob("*.py")}


def test_no_module_is_longer_than_400_lines_unless_its_first_line_gives_the_reason():
    modules = _module_texts()
    said = {path for path, lines in modules.items() if lines and lines[0].startswith(REASON)
            and lines[0][len(REASON):].strip()}
    unsaid = sorted(path for path, lines in modules.items() if len(lines) > MAX_MODULE_LINES and path not in said)
    assert not unsaid, f"modules over {MAX_MODULE_LINES} lines (split them, or say why on line 1: {REASON!r}): {unsaid}"
    # a reason that no longer holds goes, so the first lines stay the truth
    stale = sorted(path for path, lines in modules.items() if len(lines) <= MAX_MODULE_LINES and lines
                   and lines[0].startswith(REASON))
    assert not stale, f"modules saying {REASON!r} at {MAX_MODULE_LINES} lines or fewer: {stale}"


def test_no_module_imports_a_pytest_module():
    pytest_modules = {p.stem for d in ("microbench", "tests") for p in (REPO / d).rglob("*.py")
                      if p.stem.startswith(("bench_", "test_", "conftest"))}
    offenders = []
    for path in [*(REPO / "harness").rglob("*.py"), *(REPO / "kernels").rglob("*.py"),
                 *(REPO / "microbench").glob("*.py"), *(REPO / "tests").rglob("*.py")]:
        for name in _imports(path, "x.y"):
            if name.split(".")[0] == "microbench" or name.rpartition(".")[2] in pytest_modules - {"conftest"} \
                    or name.split(".")[0] in pytest_modules:
                offenders.append((str(path.relative_to(REPO)), name))
    assert not offenders


def test_nothing_imports_the_folders_by_their_generic_names():
    """Installed, only `verifybench.*` exists: an import of `kernels` or `harness` (statement or importlib string)
    works only from a checkout's root, and there it loads a second copy of the module."""
    generic = {*ROOTS, "microbench"}
    offenders = []
    # the project's own folders, not whatever else lies in the checkout (build/, a CI's package folder)
    for path in [p for folder in (*ROOTS, "microbench", "scripts", "tests") for p in (REPO / folder).rglob("*.py")]:
        tree = ast.parse(path.read_text())
        names = _imports(path, "x.y") | {n.args[0].value for n in ast.walk(tree) if isinstance(n, ast.Call)
                                         and getattr(n.func, "attr", getattr(n.func, "id", "")) == "import_module"
                                         and n.args and isinstance(n.args[0], ast.Constant)}
        offenders += [(str(path.relative_to(REPO)), n) for n in names if str(n).split(".")[0] in generic]
    assert not offenders


def test_the_wheel_installs_one_import_root_of_our_own(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheel = next(tmp_path.glob("verifybench-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"verifybench"}
    assert any(n.startswith("verifybench/harness/measure/timing/timer.py") for n in names)
    for family in ("mla_decode", "moe_int4", "skinny_gemm"):  # each shipped table beside its family's configs.py
        assert f"verifybench/kernels/{family}/{family}_configs.json" in names, family
    assert not any(n.startswith(("harness/", "kernels/", "microbench/")) for n in names)


def test_ci_install_says_each_step_before_it_runs():
    """.ci/install was silent for about a minute (imports, pip): each check and each install is announced by a `say`
    line on the line before it or on its own. Read, not run: running it would install into this environment."""
    lines = [line.strip() for line in (REPO / ".ci" / "install").read_text().splitlines()
             if line.strip() and not line.strip().startswith("#")]
    steps = [i for i, line in enumerate(lines) if re.search(r"\bhas (torch|triton)\b|\bpip_install\b|^for spec", line)
             and not line.startswith(("pip_install()", "||", "has \"$module\""))]
    unsaid = [lines[i] for i in steps if "say " not in lines[i] and not lines[i - 1].startswith("say ")]
    assert len(steps) >= 6 and not unsaid


BARE_EXIT = re.compile(r"^\s*((return|sys\.exit\(|raise SystemExit\(|os\._exit\(|hard_exit\()\s*(1|2|130|141)\)?"
                       r"|return [01] if .* else [01])\s*(#.*)?$")


def test_exit_codes_are_named_outside_exits_py():
    """A command's exit status is one of harness/measure/exits.py's constants, never a bare 1, 2, 130 or 141 (a
    bare `return 0` of a helper stays: 0 is also a count)."""
    bare = []
    for folder in ("harness", "scripts", "microbench"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.name == "exits.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if BARE_EXIT.match(line):
                    bare.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not bare, "use harness/measure/exits.py's constants:\n" + "\n".join(bare)


def test_every_setting_is_read_through_settings_py_and_listed_in_the_docs():
    """A VERIFYBENCH_* variable the code names is one kernels/common/settings.py lists (and reads: no os.environ of
    one elsewhere), and docs/measuring.md's Settings table lists the same variables."""
    from verifybench.kernels.common import settings

    named, direct = set(), []
    for folder in ("harness", "kernels"):
        for path in sorted((REPO / folder).rglob("*.py")):
            text = path.read_text()
            named |= set(re.findall(r"VERIFYBENCH_[A-Z0-9_]*[A-Z0-9]", text))
            if path.name != "settings.py":
                direct += [f"{path.relative_to(REPO)}: {line.strip()}" for line in text.splitlines()
                           if re.search(r"(environ|getenv).*VERIFYBENCH_", line)]
    assert named <= set(settings.VARIABLES), sorted(named - set(settings.VARIABLES))
    assert not direct, direct
    table = (REPO / "docs" / "measuring.md").read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^\| `(VERIFYBENCH_\w+)`", table, re.M) == list(settings.VARIABLES)
