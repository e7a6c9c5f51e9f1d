"""Tier drivers: they move bytes only. Each imports nothing but tiers.base and errors."""
