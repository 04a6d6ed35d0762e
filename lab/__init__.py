"""The lab: instruments that each served one investigation of the engine (host-phase timers,
host replays of drafting and plain steps, step, decode and prefill cost profilers, policy
simulators, A/B and loss-split helpers, kernel and identity checks), kept runnable from the repository root
(`python -m lab.NAME ...`). Not installed by pip and never imported by specserve/; what they
found is in docs/journal/."""
