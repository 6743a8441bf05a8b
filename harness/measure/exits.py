"""The exit codes of every command and torchrun job, in one place (README "Exit codes")."""
EXIT_OK = 0  # done: every check passed, no regression
EXIT_FAILED = 1  # a check failed, or compare found a regression
EXIT_BAD_INPUT = 2  # an input refused, named in one line on stderr, before anything is measured
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: stdout's reader left (`verifybench advise | head`), as a shell reports it
# a torchrun rank's own exit (multigpu/watchdog.py): the launcher names the first failing rank's
EXIT_RANK_ERROR = 1  # this rank raised
EXIT_PEER_FAILED = 3  # a peer reported an error, stopped beating, or the store went away
EXIT_STUCK = 4  # this rank is the one that stopped making progress
EXIT_WAITED = 5  # this rank gave up waiting for a stuck peer
EXIT_FAULT = 7  # injected crash (--fault exit-early:RANK)
