"""`python -m diagnostics.distributed LAYER SHARDED [options]`: the sharded audit's command (`_command`), as
`attention-audit sharded LAYER SHARDED [options]` runs it, with the same exit statuses."""

from __future__ import annotations

import sys

from .._cli import EXIT_STATUS, EXIT_USAGE
from ._command import sharded_main


def main(argv=None) -> int:
    return sharded_main(sys.argv[1:] if argv is None else argv, prog="python -m diagnostics.distributed",
                        statuses=EXIT_STATUS, usage=EXIT_USAGE)


if __name__ == "__main__":
    sys.exit(main())
