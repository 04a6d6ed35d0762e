"""N-gram drafting: a trie of the n-grams every request has seen (C, compiled on first use:
trie.c / trie.py; the pure-Python reference trie_py.py), the thread that writes it beside
the step loop (writer.py) and the drafter that proposes from it (drafter.py)."""
