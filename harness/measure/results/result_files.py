"""Result files by name: a file's kind from its name (the prefix before -<UTC stamp>, or a curated baseline's stem),
the latest file of a kind in a folder, and the one input a command takes from a file, a folder or a glob."""
from __future__ import annotations

import re
from pathlib import Path

from verifybench.harness.measure.results.store import ResultsError

STAMPED = re.compile(r"^(?P<kind>.+?)-(?P<stamp>[0-9]{8}T[0-9]{6}Z)(?:-(?P<i>[0-9]+))?$")


def _stem(path: Path) -> str | None:
    for suffix in (".json.gz", ".json"):
        if path.name.endswith(suffix):
            return path.name[:-len(suffix)]
    return None


def kind_of(path: Path) -> str | None:
    """The kind of result a file name says: the prefix before -<UTC stamp> (verify-20261202T101010Z.json ->
    verify), or a curated baseline's stem (baselines/<machine>/verify.json -> verify); None: not a JSON name."""
    stem = _stem(Path(path))
    if stem is None:
        return None
    m = STAMPED.match(stem)
    return m["kind"] if m else stem


def _order(path: Path) -> tuple:
    """Oldest first: a curated (unstamped) file, then by UTC stamp, then by the number write_new added."""
    m = STAMPED.match(_stem(path) or "")
    return (1, m["stamp"], int(m["i"] or 1)) if m else (0, "", 0)


def latest(paths, kind: str, where: str) -> Path | None:
    """The newest of `paths` that are of `kind`; ResultsError when two curated files of it cannot be ordered."""
    found = sorted((p for p in paths if kind_of(p) == kind and Path(p).is_file()), key=_order)
    if len(found) > 1 and _order(found[-1]) == _order(found[-2]):
        raise ResultsError(f"{where}: {found[-2].name} and {found[-1].name} are both {kind} results and their names "
                           "carry no UTC time to choose by; give one file")
    return found[-1] if found else None


def latest_of_kind(folder: Path, kind: str) -> Path | None:
    """The newest result file of `kind` in `folder` (not its subfolders), by the UTC time in the names."""
    return latest(Path(folder).iterdir(), kind, str(folder))


def kinds_in(folder: Path) -> list[str]:
    return sorted({k for p in Path(folder).iterdir() if (k := kind_of(p)) and p.is_file()})


def pick_input(given, kinds, option: str) -> tuple[Path, str]:
    """One result file from what a user gave for one input: a file; a folder (its latest file of the first of
    `kinds` it holds); or several files of one kind, as a shell glob expands (the latest of them). Returns (path,
    a note saying which was chosen, or "" for a file given alone); ResultsError naming the input otherwise."""
    paths = [Path(p) for p in ([given] if isinstance(given, (str, Path)) else given)]
    if len(paths) == 1 and not paths[0].is_dir():
        return paths[0], ""
    if len(paths) == 1:
        folder = paths[0]
        if not kinds:
            raise ResultsError(f"{option} {folder}: a folder; name the kind of result to take from it")
        for kind in kinds:
            found = latest_of_kind(folder, kind)
            if found is not None:
                return found, f"{option}: {found} (the latest {kind} result in {folder})"
        raise ResultsError(f"{option} {folder}: no {' or '.join(kinds)} result in this folder (it holds: "
                           f"{', '.join(kinds_in(folder)) or 'none'})")
    if any(p.is_dir() for p in paths):
        raise ResultsError(f"{option}: give one folder or result files, not both ({', '.join(map(str, paths))})")
    named = sorted({kind_of(p) or "?" for p in paths})
    if len(named) > 1:
        raise ResultsError(f"{option}: {len(paths)} files of different kinds ({', '.join(named)}); give one")
    if kinds and named[0] not in kinds:
        raise ResultsError(f"{option}: {len(paths)} {named[0]} files; this needs a {' or '.join(kinds)} result")
    if any(not STAMPED.match(_stem(p) or "") for p in paths):
        raise ResultsError(f"{option}: {len(paths)} files whose names carry no UTC time to choose by; give one")
    found = latest(paths, named[0], option)
    if found is None:
        raise ResultsError(f"{option}: none of the {len(paths)} files given exists")
    return found, f"{option}: {found} (the latest of the {len(paths)} files given)"
