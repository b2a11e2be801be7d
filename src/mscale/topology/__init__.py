"""Cluster topology: launcher environments and rank placement (hostlist syntax: mscale.hostlist)."""
