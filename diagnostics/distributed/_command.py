"""The sharded audit's command, `attention-audit sharded LAYER SHARDED [options]` (and `python -m
diagnostics.distributed LAYER SHARDED [options]`): audit a sharded layer against its unsharded self.

LAYER names the unsharded layer as `attention-audit` reads a target (pkg.module:object: a module, a class built with
no arguments, or a zero-argument factory); SHARDED names the factory `(layer, rank, world_size, group) -> module` that
builds its sharded form on one rank. Exit status as `attention-audit`'s: 0 passed, 1 findings, 2 usage error,
3 inconclusive. Example, with the reference's ring attention:

    attention-audit sharded mymodule:make_layer mymodule:make_ring --causal --layout zigzag

The front ends (`diagnostics._cli`, this package's `__main__`) hand in the exit statuses, which are theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .._errors import AuditUsageError


def parser(prog: str = "attention-audit sharded") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="audit a sharded layer against its unsharded self")
    p.add_argument("layer", help="the unsharded layer: pkg.module:object (a module, class or zero-argument factory)")
    p.add_argument("sharded", help="the factory (layer, rank, world_size, group) -> the sharded module on one rank")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="world sizes to audit (default 2 4)")
    p.add_argument("--causal", action="store_true", help="the layer promises causality")
    p.add_argument("--takes", choices=("shard", "full"), default="shard",
                   help="shard: m(x_shard, positions) returns its shard's output; full: m(x) the whole output")
    p.add_argument("--layout", choices=("contiguous", "zigzag", "striped"), default="contiguous",
                   help="how the audit cuts the sequence for --takes shard")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--dtype", choices=("float32", "float64"), default=None)
    p.add_argument("--timeout", type=float, default=30.0, help="collective timeout in seconds (a rank silent for "
                                                              "this + 2 s has hung)")
    p.add_argument("--draws-like-unsharded", action="store_true",
                   help="the layer promises that in train mode it draws what the unsharded layer draws (--takes full)")
    p.add_argument("--documents", type=int, nargs="+", default=None, metavar="LENGTH",
                   help="packed documents: their lengths, summing to --seq-len (the layer attends within each)")
    p.add_argument("--data-parallel", type=int, default=1, metavar="DP",
                   help="the ranks are DP data-parallel replicas of W / DP context-parallel ranks (--takes shard)")
    p.add_argument("--html", default=None, metavar="PATH", help="also write the report as an HTML page")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def sharded_main(argv, *, prog: str, statuses: dict, usage: int) -> int:
    """Parse `argv` (the options after `sharded`), run the audit, print the report; the exit status: `statuses`
    [the report's status], or `usage` for a usage error (with one line on stderr)."""
    args = parser(prog).parse_args(argv)
    from .._load import importable_from, load_layer, quiet_numpy_warning, resolve

    quiet_numpy_warning()  # before torch loads: this project does not use NumPy
    importable_from(os.getcwd())  # `mymodule:make_layer` from a scratch directory, as attention-audit reads it
    try:
        import torch

        from . import audit_sharded

        report = audit_sharded(load_layer(args.layer), resolve(args.sharded), world_sizes=tuple(args.world_sizes),
                               causal=args.causal, takes=args.takes, layout=args.layout, seq_len=args.seq_len,
                               num_heads=args.num_heads, timeout=args.timeout,
                               draws_like_unsharded=args.draws_like_unsharded, documents=args.documents,
                               data_parallel=args.data_parallel,
                               dtype=None if args.dtype is None else getattr(torch, args.dtype))
        if args.html:
            report.to_html(args.html)
    except AuditUsageError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return usage
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return statuses[report.status]


__all__ = ["parser", "sharded_main"]
