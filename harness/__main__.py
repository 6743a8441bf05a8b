"""`python -m harness ...` is `verifybench ...` without installing the package."""
import sys

from harness.cli import main

sys.exit(main())
