"""The relay's Prefect side, between the flows and relay.orchestrator (which knows nothing of Prefect):
- relay_host.py: a relay's context in a flow run and the host its steps (relay/orchestrator/relay_step.py, the
  relay's algorithm) run in: its Kaggle calls as tasks, its log, its artifacts;
- account_slots.py: the scheduler of an account's session slots (a Prefect global concurrency limit, the one
  count of the spec's cap) both flows push under; slot_queue.py: their turns across flow runs;
- step_lock.py run_step_locks.py: one step at a time per relay (one lease for all of a `relays` run's relays);
- relay_tasks.py: the Kaggle calls as Prefect tasks with retries (observe, push, hand over, the quota);
- artifacts.py relays_artifacts.py live_view.py run_labels.py notify.py: what a person sees and is told;
- prefect_writes.py quiet_logs.py: Prefect's server and log lines, made to fit the relay."""
