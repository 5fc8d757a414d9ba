import sys

from moajax.cli import main

sys.exit(main())
