"""The rules of `mscale watch`, each a few numpy reductions over the recent rows of a run.

`rows.Rows` keeps the judged rows (warm-up, checkpoint, GC and every-rank-at-once spikes left
out) in a ring of fixed size; `straggler` names slow ranks, nodes, links, data loaders and
pipeline stages; `imbalance` finds a slow replica that moves from step to step; `joblevel`
compares the job with its own baseline; `training` watches loss and gradient norm. The judge
(`mscale.watch.judge.Watcher`) runs them row by row and keeps each finding open until it clears.
"""
