"""The ``moajax`` command line: ``moajax derive [--list | KERNEL]``."""

from __future__ import annotations

import argparse
import sys


def _kernels():
    import moajax.kernels  # noqa: F401 - registers the seed kernels
    from moajax.kernel import REGISTRY

    return REGISTRY


def cmd_derive(args) -> int:
    reg = _kernels()
    if args.list or not args.kernel:
        width = max(len(n) for n in reg)
        for name, k in reg.items():
            doc = (k.fn.__doc__ or "").strip().splitlines()[0]
            sig = ", ".join(f"{p.name}[{' '.join(p.dims)}]" for p in k.params)
            print(f"{name:<{width}}  ({sig})  {doc}")
        return 0
    names = list(reg) if args.kernel == ["all"] else args.kernel
    for name in names:
        if name not in reg:
            print(f"moajax derive: unknown kernel {name!r}; known: {', '.join(reg)}", file=sys.stderr)
            return 2
        k = reg[name]
        print(f"== {name}: example sizes {k.example}")
        print(k.dnf().pretty())
        print()
        print(k.derivation().pretty(max_steps=None if args.full else 60))
        print()
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moajax", description="Mathematics of Arrays kernels for JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("derive", help="print a kernel's DNF and its ψ-reduction")
    d.add_argument("kernel", nargs="*", help="kernel name(s), or 'all'")
    d.add_argument("--list", action="store_true", help="list the kernels")
    d.add_argument("--full", action="store_true", help="print every derivation step")
    d.set_defaults(func=cmd_derive)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
