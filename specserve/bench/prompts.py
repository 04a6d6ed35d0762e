"""A fixed set of short, varied prompts (prose, code, arithmetic, lists) shared by the
correctness checks on the GPU and the CPU tests."""

SAMPLE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
    "Write a haiku about the sea.",
    "Q: What is 17 * 23?\nA:",
    "Once upon a time, in a small village by the mountains, there lived",
    "List three colors:",
    "import numpy as np\n\ndef softmax(x):",
    "The theory of relativity says that",
]
