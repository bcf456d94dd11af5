"""Prefect tasks: thin wrappers over relay.orchestrator.handoff / relay.orchestrator.plan / relay.orchestrator.report with retries and artifacts."""
