import sys

from relay.emulator.serve_command import main

sys.exit(main())
