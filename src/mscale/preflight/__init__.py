"""`mscale preflight`: check the cluster on the exact groups the plan will use; name the bad nodes."""
