"""Planning thousand-GPU jobs before the cluster exists: the per-GPU memory model (:mod:`.memory`), the layout
planner and its cost model (:mod:`.plan`), and the single-process dry run that builds every process group and the
model on the meta device for one rank of a large world (:mod:`.dry_run`)."""
