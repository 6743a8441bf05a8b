"""`verifybench`: the command line. Thin: each command lives in a module with add_arguments(parser) and run(args);
each registered component (harness/components) is also a command of its own.

Exit codes, everywhere: 0 done (no regression, every check passed), 1 a check failed or compare found a
regression, 2 bad input (named in one line on stderr), 130 interrupted (Ctrl-C: one line; every file is written
whole or not at all, so what is left is complete), 141 stdout closed by its reader (`| head`: quietly, as a Unix
tool killed by SIGPIPE).
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from verifybench.harness.measure.host import interpreter
from verifybench.harness.measure.exits import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_STDOUT_CLOSED

INTERRUPTED = "verifybench: interrupted; the files already saved are complete, nothing half-written is left"


def _interrupted_line(interrupt: BaseException | None = None) -> str:
    """INTERRUPTED, and what the interrupted job saved where it says so (KeyboardInterrupt("<what is where>"))."""
    detail = interrupt.args[0] if interrupt is not None and interrupt.args else ""
    return f"{INTERRUPTED}; {detail}" if detail else INTERRUPTED


def _interrupted_exit(interrupt: BaseException | None = None) -> None:
    print(_interrupted_line(interrupt), file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_INTERRUPTED)


def _exit_on_sigint(signum, frame) -> None:
    _interrupted_exit()


def quiet_sigint(on: bool, before=None):
    """While imports run and arguments are parsed, Ctrl-C exits at once (one line, 130): a KeyboardInterrupt raised
    inside torch's, numpy's or triton's import leaves them half-initialised and ends in an unrelated traceback, and
    nothing is written yet. Returns the handler it replaced; off restores `before`. Left alone where the handler is
    not Python's default (an ignored SIGINT, a test runner's own)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    if on:
        return signal.signal(signal.SIGINT, _exit_on_sigint) \
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler else None
    if before is not None:
        signal.signal(signal.SIGINT, before)
    return None


# Before any component (and so any kernel) is imported: without a GPU the Triton kernels run in the interpreter.
_before = quiet_sigint(True)
interpreter.enable_without_gpu()  # imports torch: most of a command's first second
quiet_sigint(False, _before)

from verifybench.harness.analysis.numbers import Parser  # noqa: E402

# name -> (module with add_arguments/run, one-line help). Components are added from the registry.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("verifybench.harness.run", "the main job: every component for a preset, result JSON + markdown report + "
            "charts"),
    "compare": ("verifybench.harness.measure.results.compare", "noise-aware comparison of two result files: SAME / "
                "FAST / SLOW / AMBG per case"),
    "tune": ("verifybench.harness.tune", "tune the Triton kernels' configs for this GPU (writes a per-user table)"),
    "env": ("verifybench.harness.measure.env", "the run fingerprint: GPUs, links, clocks, versions, "
            "NCCL_*/CUDA_*/TORCH_* variables"),
    "project": ("verifybench.harness.answers.project", "what-if: a stored verify decomposition on another GPU "
                "described by numbers"),
    "plan": ("verifybench.harness.answers.plan", "rank (steps, topk, draft tokens) by tokens/s from measured costs "
             "and an acceptance profile, with the break-even accept length"),
    "advise": ("verifybench.harness.answers.advise", "the answer first, then the levers that move a verify cycle, "
               "ranked by ms saved, with the engine setting for each"),
    "breakeven": ("verifybench.harness.analysis.breakeven", "speedup and break-even accept length of speculative "
                  "decoding"),
    "trace": ("verifybench.harness.answers.trace", "decompose an engine's profiler trace (SGLang, vLLM, or the "
              "suite's own) into the suite's components, with GPU idle time"),
    "record": ("verifybench.harness.record", "record a profiler trace of the suite's own verify "
               "forward (GPU), for `verifybench trace`"),
    "hostprobe": ("verifybench.harness.measure.hostnoise", "how much this host's CPU speed wanders (host-timed "
                  "figures follow it)"),
}


def build_parser() -> argparse.ArgumentParser:
    from verifybench.harness import components, run
    from verifybench.harness.measure.timing.modes import MODE_HELP

    p = Parser(
        prog="verifybench",
        description="Device-timed microbenchmarks that explain the speculative-decoding verify step of large "
        "tensor-parallel MoE models, on your GPUs. Timing modes: "
        + "; ".join(f"{k}: {v}" for k, v in MODE_HELP.items()),
        epilog="Exit codes: 0 ok, 1 a check failed or a regression, 2 bad input, 130 interrupted, 141 stdout "
               "closed by its reader (quietly).")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        q = sub.add_parser(name, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(q)
        q.set_defaults(func=module.run)
    for name in components.REGISTRY:
        module = components.load(name)
        q = sub.add_parser(name, help=f"component: {module.HELP}", description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        run.add_scope_arguments(q, tokens=getattr(module, "TAKES_TOKENS", True),
                                batch=getattr(module, "TAKES_BATCH", False))
        if hasattr(module, "add_arguments"):  # the component's own options, passed to its cases
            module.add_arguments(q)
        q.set_defaults(func=run.run_one)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        if argv is None:  # done: a Ctrl-C while the process exits would kill it by SIGINT, with no word and no 130
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        return code
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt as interrupt:
        if argv is None:  # the process's own command line: a second Ctrl-C must not turn the exit into a traceback
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if argv is None:
            # exit 130 as promised: CPython dies by SIGINT at exit instead, even once the KeyboardInterrupt is caught,
            # when it passed through an exec() of a string (scipy.stats builds its distributions so)
            _interrupted_exit(interrupt)
        print(_interrupted_line(interrupt), file=sys.stderr)
        return EXIT_INTERRUPTED


def _stdout_closed() -> int:
    """stdout's reader left (a pipe into head that has read its lines): end quietly. stdout goes to /dev/null first, or
    Python's flush at exit would fail on the closed pipe again and print its own complaint."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout with no file descriptor (a test's capture): nothing left to flush
        pass
    return EXIT_STDOUT_CLOSED


def _main(argv: list[str] | None) -> int:
    from verifybench.harness.measure.results.store import ResultsError

    before = quiet_sigint(True)  # build_parser imports every command's module
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or an argument argparse refused (2, its message already printed)
        return int(e.code or 0)
    finally:
        quiet_sigint(False, before)
    try:
        return args.func(args)
    except (ValueError, ResultsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # an input that cannot be read, an output that cannot be written
        if isinstance(e, BrokenPipeError):  # not bad input: the reader of stdout left (main ends quietly)
            raise
        print(f"error: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
