"""Probes of the result files: every kind of damaged or doctored result given to compare, either way round, and
compare's verdicts and options."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from probe_base import Case, _c, _edited, _suite, cli


def _pb(path: Path, stats: dict) -> Path:
    path.write_text(json.dumps({"machine_info": {}, "benchmarks": [{"name": "t", "stats": stats}]}))
    return path


BAD_FILES = {
    "missing": lambda p: p.parent / f"missing-{p.name}",
    "a folder": lambda p: (p.mkdir(exist_ok=True), p)[1],
    "empty": lambda p: (p.write_text(""), p)[1],
    "truncated": lambda p: (p.write_text(_suite(p).read_text()[:300]), p)[1],
    "a JSON list": lambda p: (p.write_text("[1, 2]"), p)[1],
    "foreign object": lambda p: (p.write_text('{"hello": 1}'), p)[1],
    "future schema": lambda p: _edited(_suite(p), lambda d: d.update(schema_version=99)),
    "cases not a list": lambda p: _edited(_suite(p), lambda d: d.update(cases={})),
    "case without name": lambda p: _edited(_suite(p), lambda d: _c(d).pop("name")),
    "case without check": lambda p: _edited(_suite(p), lambda d: _c(d).pop("check")),
    "passed without samples": lambda p: _edited(_suite(p), lambda d: _c(d).pop("samples_us")),
    "empty samples": lambda p: _edited(_suite(p), lambda d: _c(d).update(samples_us=[])),
    "all-null samples": lambda p: _edited(_suite(p), lambda d: _c(d).update(samples_us=[None] * 50)),
    "one null sample": lambda p: _edited(_suite(p), lambda d: _c(d)["samples_us"].__setitem__(0, None)),
    "a string sample": lambda p: _edited(_suite(p), lambda d: _c(d)["samples_us"].__setitem__(0, "1")),
    "a boolean sample": lambda p: _edited(_suite(p), lambda d: _c(d)["samples_us"].__setitem__(0, True)),
    "negative samples": lambda p: _edited(_suite(p), lambda d: _c(d).update(samples_us=[-v for v in _c(d)["samples_us"]])),
    "samples a dict": lambda p: _edited(_suite(p), lambda d: _c(d).update(samples_us={"a": 1})),
    "null median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(median_us=None)),
    "missing median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].pop("median_us")),
    "zero median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(median_us=0)),
    "negative median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(median_us=-4.0)),
    "string median": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(median_us="100")),
    "samples 5% slower under a stale summary": lambda p: _edited(_suite(p), lambda d: _c(d).update(
        samples_us=[v * 1.05 for v in _c(d)["samples_us"]])),
    "stale sample count": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(n=7)),
    "stale min": lambda p: _edited(_suite(p), lambda d: _c(d)["summary"].update(min_us=1.0)),
    "summary not an object": lambda p: _edited(_suite(p), lambda d: _c(d).update(summary=[1])),
    "mode missing": lambda p: _edited(_suite(p), lambda d: _c(d).pop("mode")),
    "duplicate case": lambda p: _edited(_suite(p), lambda d: d["cases"].append(_c(d))),
    "gpu entry malformed": lambda p: _edited(_suite(p), lambda d: d["fingerprint"].update(gpus=[1])),
    "broken gzip": lambda p: (p.with_suffix(".gz").write_bytes(b"not gzip"), p.with_suffix(".gz"))[1],
    "pb: benchmarks not a list": lambda p: (p.write_text('{"machine_info": {}, "benchmarks": {}}'), p)[1],
    "pb: entry without stats": lambda p: (p.write_text('{"machine_info": {}, "benchmarks": [{"name": "t"}]}'), p)[1],
    "pb: zero median": lambda p: _pb(p, {"median": 0, "q1": 0, "q3": 0}),
    "pb: null median": lambda p: _pb(p, {"median": None, "q1": 1e-5, "q3": 1e-5}),
    "pb: null data": lambda p: _pb(p, {"median": 1e-5, "q1": 1e-5, "q3": 1e-5, "data": [None, None]}),
    "pb: data under a stale median": lambda p: _pb(p, {"median": 1e-5, "q1": 1e-5, "q3": 1e-5, "data": [2e-5] * 9}),
    "pb: q1 above the median": lambda p: _pb(p, {"median": 1e-5, "q1": 2e-5, "q3": 3e-5}),
    "pb: fingerprint not an object": lambda p: (p.write_text(json.dumps({"machine_info": {"verifybench": "x"},
                                                                          "benchmarks": []})), p)[1],
}


def _verdict(rc: int, word: str):
    def check(res):
        return res.value == rc and f"{word} 1" in res.out, f"exit {res.value}, wants {rc} with {word}"
    return check


def compare_cases(work: Path) -> list[Case]:
    d = work / "compare"
    d.mkdir()
    good = _suite(d / "good.json")
    out = []
    for i, (which, make) in enumerate(BAD_FILES.items()):
        bad = make(d / f"bad{i}.json")
        needle = str(bad) if which != "missing" else "no such file"
        out.append(cli("compare", ["compare", good, bad], needle))
        out[-1].name = f"compare GOOD <{which}>"
        out.append(cli("compare", ["compare", bad, good], needle))
        out[-1].name = f"compare <{which}> GOOD"
    rng = np.random.default_rng
    same = _suite(d / "same.json", {"x": rng(2).normal(100, 0.5, 50)})
    slow = _suite(d / "slow.json", {"x": rng(3).normal(105, 0.5, 50)})
    fast = _suite(d / "fast.json", {"x": rng(4).normal(95, 0.5, 50)})
    for name, new, rc, word in (("same", same, 0, "SAME"), ("5% slower", slow, 1, "SLOW"), ("5% faster", fast, 0,
                                                                                            "FAST")):
        out.append(cli("compare", ["compare", good, new], bad=False, check=_verdict(rc, word)))
        out[-1].name = f"compare GOOD <{name}>"
    for argv, needle in (([good, good, "--min-effect", "nan"], "--min-effect"),
                         ([good, good, "--min-effect", "inf"], "--min-effect"),
                         ([good, good, "--min-effect", "-0.1"], "--min-effect"),
                         ([good, good, "--alpha", "nan"], "--alpha"), ([good, good, "--alpha", "0"], "--alpha"),
                         ([good, good, "--alpha", "1"], "--alpha"), ([good], "new")):
        out.append(cli("compare", ["compare", *argv], needle))
    other = _edited(_suite(d / "h100.json"), lambda x: x["fingerprint"].update(gpus=[{"name": "NVIDIA H100"}],
                                                                              gpu_model="NVIDIA H100"))
    out.append(cli("compare", ["compare", good, other], "different GPU models"))
    return out
