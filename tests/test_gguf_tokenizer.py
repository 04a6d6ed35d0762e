"""A GGUF's byte-level BPE tokenizer built from its header (gguf_tokenizer.py) behaves as the
tokenizer transformers builds from the same file (saved and loaded again, which is what the
loader's disk cache returned before: the model's tokenizer class with its normalizer), on
text, special tokens and chat templates; other files fall back to transformers."""
from __future__ import annotations

import os

import numpy as np
import pytest

from specserve.model import loader
from specserve.model.gguf_file import GGUFFile
from specserve.model.gguf_tokenizer import build_gguf_tokenizer

TEXTS = [
    "Hello, world! How's it going? I'd say we'll see.",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    return [x for x in xs if x < xs[0]]",
    "Numbers: 12345 6789.01 -3e10, 2024-11-28",
    "  leading spaces\tand tabs\r\nand\n\n\nblank lines   ",
    "ünïcödé 日本語のテキスト 😀👍 مرحبا Ελληνικά",
    "combining: e\u0301 vs \u00e9, A\u030a vs \u00c5",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "special tokens inside<|endoftext|>words<|im_end|>",
    "x" * 500 + " " + "ab " * 100,
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}}",
]


def reference_tokenizer(gguf_path: str, tmp_path):
    """transformers' tokenizer for the file, saved and loaded again."""
    from transformers import AutoTokenizer
    built = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    built.save_pretrained(tmp_path / "reference")
    return AutoTokenizer.from_pretrained(tmp_path / "reference")


def assert_same_tokenizer(ours, reference, texts: list[str], messages: list[dict]) -> None:
    assert ours.get_vocab() == reference.get_vocab()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids"):
        assert getattr(ours, name) == getattr(reference, name), name
    for text in texts:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    for prompt in (True, False):
        assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt))


def test_smollm2_tokenizer_matches_transformers(smollm2_path, tmp_path):
    ours = build_gguf_tokenizer(GGUFFile(smollm2_path).metadata)
    assert ours is not None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]},
                {"role": "assistant", "content": TEXTS[1]}, {"role": "user", "content": TEXTS[4]}]
    assert_same_tokenizer(ours, reference_tokenizer(smollm2_path, tmp_path), TEXTS, messages)


def write_tiny_gguf(path, pre: str = "qwen2", model: str = "gpt2", add_bos: bool = False, add_eos: bool = False) -> None:
    """A GGUF (Qwen2's architecture; Llama's for Llama 3's pre-tokenizer) with a byte-level
    vocabulary, a few merges (one joins an 'e' with a combining accent's first byte: NFC
    decides whether it applies; one joins two digits), control tokens and a user-defined
    one, a chat template and one tensor."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e Ì", "1 2"]
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
    writer = gguf.GGUFWriter(str(path), "llama" if pre == "llama-bpe" else "qwen2")
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(4)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens + specials)
    writer.add_token_types([1] * len(tokens) + [3, 3, 3, 4])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens))
    writer.add_eos_token_id(len(tokens) + 2)
    writer.add_pad_token_id(len(tokens))
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens) + 4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("pre,add_bos", [("qwen2", False), ("llama-bpe", True)])
def test_pre_tokenizers_bos_and_added_tokens_match_transformers(tmp_path, pre, add_bos):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre=pre, add_bos=add_bos)
    ours = build_gguf_tokenizer(GGUFFile(str(path)).metadata)
    texts = TEXTS + ["the theatre in a tin", "e\u0301t\u00e9 <tool>call<|im_end|>", "'S 'LL 're", "1212 12 123456"]
    reference = reference_tokenizer(str(path), tmp_path)
    assert_same_tokenizer(ours, reference, texts, [{"role": "user", "content": texts[-3]}])
    vocab = ours.get_vocab()
    assert ours.encode("<tool>", add_special_tokens=False) == [vocab["<tool>"]]   # a user-defined token stays whole
    assert (ours.encode("x")[0] == vocab["<|endoftext|>"]) == add_bos   # the file's BOS, where it asks for one
    # Qwen2 normalizes to NFC first; Llama 3 does not
    assert (ours.encode("e\u0301") == ours.encode("\u00e9")) == (pre == "qwen2")


@pytest.mark.parametrize("pre,model,add_eos", [("tekken", "gpt2", False), ("qwen2", "llama", False),
                                               ("qwen2", "gpt2", True)])
def test_other_tokenizers_fall_back_to_transformers(tmp_path, monkeypatch, pre, model, add_eos):
    """A file whose pre-tokenizer or tokenizer model this module does not build, or that wants
    an EOS after every text: transformers' build, cached on disk (the second load reads it)."""
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, pre=pre, model=model, add_eos=add_eos)
    assert build_gguf_tokenizer(GGUFFile(str(path)).metadata) is None
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    first = loader.load_tokenizer(str(path))
    assert os.listdir(tmp_path / "cache" / "tokenizers")
    second = loader.load_tokenizer(str(path))
    assert first.encode("the theatre in a tin") == second.encode("the theatre in a tin")


def test_the_loader_builds_a_byte_level_bpe_tokenizer_without_transformers_gguf_path(smollm2_path, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    tokenizer = loader.load_tokenizer(smollm2_path)
    assert tokenizer.encode("Hello world") == build_gguf_tokenizer(GGUFFile(smollm2_path).metadata).encode("Hello world")
    assert not os.path.exists(tmp_path / "cache")   # nothing rebuilt by transformers, nothing cached
