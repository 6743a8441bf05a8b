"""`python3 -m verifybench.harness ...` is the `verifybench` command."""
import sys

from verifybench.harness.cli import main

sys.exit(main())
