"""Schedules driven by the optimizer step: the learning rate (WSD, cosine, ...)."""

from megatron_ext.schedules.lr import DecayStyle, LRSchedule, WsdDecayStyle

__all__ = ["DecayStyle", "LRSchedule", "WsdDecayStyle"]
