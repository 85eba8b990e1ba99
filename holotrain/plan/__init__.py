"""The planner: every lever chosen per job from a calibrated cost model and short trials (`holotrain plan`)."""

from holotrain.plan.planner import make_plan, plan_overrides, print_table

__all__ = ["make_plan", "plan_overrides", "print_table"]
