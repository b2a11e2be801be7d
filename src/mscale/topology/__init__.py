"""Cluster topology: hostlists, launcher environments, and rank placement."""
