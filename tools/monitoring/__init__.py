"""Monitoring helpers: render the role's Prometheus templates for promtool, check the dashboard's queries."""
