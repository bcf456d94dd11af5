import sys

from relay.kaggle.emulator.cli import main

sys.exit(main())
