import sys

from tensorpar.cli import main

if __name__ == "__main__":   # the spawned ranks of --discover-plan's proof re-import this module
    sys.exit(main())
