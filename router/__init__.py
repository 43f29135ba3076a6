"""Switchyard router: difficulty scoring and routing decisions. No network, no torch."""
