"""Experiments over trained runs: `hydra-lm compare` (variants at an equal budget) and `hydra-lm scaling`."""
