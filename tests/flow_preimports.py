"""TEST-ONLY: what the tests' flow processes import before their flow starts, imported once by the process they
are forked from (tests/relay_fixtures.py `start_flow_process`): Prefect's engines, the relay's flows and tasks,
the kaggle client (in the controlled environment relay/orchestrator/kaggle/client.py imports it in) and matplotlib
(its font cache built once). ~2.5 of a flow process's ~7 CPU s."""
import prefect.flow_engine  # noqa: F401
import prefect.task_engine  # noqa: F401

import flows.one_relay  # noqa: F401
import flows.relays_sharing_quota  # noqa: F401
import tasks.relay_host  # noqa: F401
from relay.orchestrator import report
from relay.orchestrator.kaggle.client import kaggle_api_class

kaggle_api_class()
report.quiet_matplotlib()
import matplotlib.backends.backend_agg  # noqa: E402,F401 - what a figure draws with
import matplotlib.figure  # noqa: E402,F401
