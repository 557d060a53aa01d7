"""``python -m aegis``: the ``aegis`` command (the same as the ``aegis`` script)."""

import sys

from aegis.cli import main

if __name__ == "__main__":
    sys.exit(main())
