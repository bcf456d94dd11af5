import sys

from relay.emulator.cli import main

sys.exit(main())
