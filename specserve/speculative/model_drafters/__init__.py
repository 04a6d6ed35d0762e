"""Drafters that run a model: a draft model (STANDALONE), an EAGLE / EAGLE-3 head, NAIVE_EAGLE
and MTP. Each drafter (eagle.py, standalone.py, fused_drafter.py) with its own KV rows
(draft_kv.py, held_states.py, head_prefix_cache.py) and its device code: the draft chain and
tree (draft_chain.py, draft_tree.py) captured as CUDA graphs (chain_graphs.py), the draft
model's and the head's runners (draft_runner.py, eagle_runner.py), and the fused step that
verifies and drafts in one device function (fused_step.py, fused_chain.py). draft_setup.py
builds them for the engine builder."""
