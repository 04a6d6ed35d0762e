"""Hybrid drafting (--speculative-hybrid-ngram): an EAGLE head and the n-gram trie, each
request's step drafted by whichever is expected to commit more (source_choice.py), both
kinds of tree verified in one step (drafter.py)."""
