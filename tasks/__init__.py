"""The relay's Prefect side, between the flows and relay.orchestrator (which knows nothing of Prefect):
- relay_step.py: one relay's step, the relay's policy over chain.decide (observe, decide, hand over, recover,
  notify, push), the one both flows take; account_slots.py: the scheduler of an account's session slots
  (a Prefect global concurrency limit) both flows push under; step_lock.py: one step at a time per relay;
- relay_tasks.py: the Kaggle calls as Prefect tasks with retries (observe, push, hand over, the quota);
- artifacts.py relays_artifacts.py live_view.py run_labels.py notify.py: what a person sees and is told;
- prefect_writes.py quiet_logs.py: Prefect's server and log lines, made to fit the relay."""
