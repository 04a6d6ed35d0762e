"""The adaptive draft length: how many draft nodes each step verifies, down to plain decoding,
chosen from measured acceptance (acceptance.py: what a cut of the draft would have
committed) and measured step prices (costs.py). policy.py holds AdaptiveDraftLength; modes,
probes, overshoot and draft cuts (TierCuts rates them) its parts; listener.py, what an instrument hears."""
