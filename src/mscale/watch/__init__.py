"""`mscale watch`: stragglers with their cause, gradient-norm spikes, NaN, divergence, throughput
regressions and hangs, judged from what `train` writes into the run directory (docs/watch.md)."""
