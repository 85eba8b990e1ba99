"""The planner: every lever chosen per job from a calibrated cost model and short trials (`holotrain plan`, in
plan/planner.py). The package itself loads nothing: its light modules (the bubble model, plan/pipeline.py) are read
by the training loop's levers, which the planner's cost model in turn imports."""
