#!/usr/bin/env python3
"""Measure this machine and write its profile: the same as ``moajax measure``.

Options: ``--out PATH`` (default: ``machines.cache_dir() / "local.toml"``, where
``moajax.machines.local()`` reads it), ``--name NAME`` (default "local"), ``--quick``.
What is measured and how: ``moajax/measure.py``. Run it on each machine you benchmark on.
"""

import sys

from moajax.cli import main

if __name__ == "__main__":
    sys.exit(main(["measure", *sys.argv[1:]]))
