"""`python -m diagnostics pkg.module:obj [--causal] [--json] ...`: the same as the `attention-audit` command."""

from ._cli import main

raise SystemExit(main(prog="python -m diagnostics"))
