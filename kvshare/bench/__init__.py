"""Benchmarks of the shared pool at the service level: cross-replica TTFT, sessions, reports, the demo,
validate service."""
