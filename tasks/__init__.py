"""Prefect tasks: thin wrappers over relay.handoff / relay.plan / relay.report with retries and artifacts."""
