"""`python -m kafka2pg`: the command line (see kafka2pg.cli)."""

import sys

if __name__ == "__main__":
    from kafka2pg.cli import main

    sys.exit(main())
