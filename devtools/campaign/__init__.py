"""The randomized fault campaign: holders, a nemesis, a fencing register and a checker (docs/safety.md)."""
