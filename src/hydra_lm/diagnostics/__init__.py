"""Measurement tools: `hydra-lm bench` (step and decode timing, profile), `hydra-lm info` (sizes,
FLOPs, memory estimate), `hydra-lm compare` (variants at an equal budget) and `hydra-lm scaling`."""
