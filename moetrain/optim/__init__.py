"""Optimizers, parameter groups, LR schedules and gradient clipping."""
