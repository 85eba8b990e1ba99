from holotrain.profile.phases import PhaseClock

__all__ = ["PhaseClock"]
