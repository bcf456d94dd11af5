"""A local Kaggle: the Kaggle API over HTTP on 127.0.0.1, running pushed kernels as local processes.

    from relay.emulator import Emulator, EmulatorConfig
    with Emulator(state_dir, EmulatorConfig(users={"me": "key"}, time_scale=3600)) as emu:
        ...  # point the kaggle client at emu.url

or from a shell: `relay emulator serve --port 8765 --state DIR` (see docs/kaggle.md).
"""
from relay.emulator.config import EmulatorConfig
from relay.emulator.server import Emulator

__all__ = ["Emulator", "EmulatorConfig"]
