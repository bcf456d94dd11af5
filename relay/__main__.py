import sys

from relay.cli import main

if __name__ == "__main__":  # spawned data-parallel ranks import this module; they must not re-run the CLI
    sys.exit(main())
