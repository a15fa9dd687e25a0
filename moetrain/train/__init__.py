"""Training: one step as a function, the loop with its cadences, and metrics."""
