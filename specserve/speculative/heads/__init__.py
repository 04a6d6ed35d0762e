"""The networks a model drafter runs besides a whole draft model: the EAGLE / EAGLE-3 head
(eagle_head.py, its config and its serving form eagle_serving.py) and the MTP layer
(mtp_head.py), their checkpoints (eagle_checkpoint.py, mtp_checkpoint.py; float8 rows in
fp8_rows.py) and FR-Spec token maps (token_map.py). Serving and the trainer both use them."""
